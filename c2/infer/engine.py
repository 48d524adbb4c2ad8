"""The inference engine: a queue of requests over a fixed set of cache slots (continuous batching).

    engine = Engine(cfg, params, slots=16, capacity=4096, draft_depth=1)
    results = engine.generate([Request(prompt_ids, SamplingParams(temperature=1.0, seed=3))])
    for event in engine.stream(request): ...
    engine.update_weights(new_params, version=7)   # taken between two steps, caches kept
Params are given as trained (layers stacked); the engine unstacks them (see `scan_layers`).

Each `step()` admits queued requests into free slots, runs one prompt chunk for up to
`prefill_rows` prefilling slots, then `decode_steps` decode steps (plain, or speculative with the
MTP drafter) for every decoding slot in one device call. A slot whose sequence finishes is free
for the next request at the next `step()`; the others never wait for it. Several decode steps per
call amortise the host's per-call cost (dispatch, transfer, bookkeeping) at the price of a
finished row idling for the rest of its call; outputs do not depend on `decode_steps` (every
draw is keyed by the request's seed and the token's position). Requests that cannot run (empty
prompt, prompt longer than a slot, ids outside the vocabulary) finish at once with finish_reason
"error" and a message; the batch goes on.

Every emitted token carries its float32 log-prob under the sampling distribution and the policy
version of the weights that produced it; every token fed to the model carries the expert ids it
was routed to at every MoE layer (`Result.routes`, uint16), for router replay in the trainer.

Prefix reuse (`prefix_cache=True`): a finished sequence leaves its cache entries in its slot; a
later request whose prompt starts with those tokens (the next turn of a multi-turn rollout: the
previous prompt, the completion, then the tool's output) takes that slot and prefills only the
rest. Entries left by older weights are never reused (a weight update forgets them all), so a
reused prefix is what a fresh prefill would compute; its routes come back from the first pass.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import threading
from typing import Callable, Iterable, Iterator, Optional, Sequence

import jax
import numpy as np

from c2 import model
from c2.infer import cache as cache_lib
from c2.infer import steps
from c2.infer.sampling import SamplingParams
from c2.model.config import ModelConfig
from c2.model.router import NOT_RECORDED


@dataclasses.dataclass
class Request:
  prompt: Sequence[int]
  sampling: SamplingParams = SamplingParams()
  id: Optional[str] = None


@dataclasses.dataclass
class Result:
  id: str
  prompt_ids: list[int]
  token_ids: list[int]
  logprobs: list[float]  # per emitted token, float32 under the sampling distribution
  versions: list[int]  # per emitted token: policy version of the weights that produced it
  routes: np.ndarray  # uint16 [prompt + completion - 1, moe_layers, top_k]: every fed token
  finish_reason: str  # "stop" | "length" | "error"
  stop: Optional[object] = None  # the stop token id or string that ended it
  error: Optional[str] = None


@dataclasses.dataclass
class TokenEvent:
  request_id: str
  token_ids: list[int]
  logprobs: list[float]
  versions: list[int]
  result: Optional[Result] = None  # set on the request's last event


def forced_routes(result: Result) -> np.ndarray:
  """int32 [moe_layers, 1, prompt + completion, top_k] for `c2.model.forward(forced_routes=)`:
  the recorded routes, and NOT_RECORDED for the last token (never fed to the sampler's model)."""
  routes = result.routes.astype(np.int32)
  tail = np.full((1,) + routes.shape[1:], NOT_RECORDED, np.int32)
  return np.concatenate([routes, tail])[:, :, None].transpose(1, 2, 0, 3)


@functools.lru_cache(maxsize=None)
def _jitted_steps(cfg: ModelConfig, draft_depth: int, decode_steps: int):
  """The jitted steps, shared by every engine of one (config, draft depth, decode steps):
  compiled once."""
  jit = lambda fn, **kw: jax.jit(functools.partial(fn, cfg=cfg, **kw), donate_argnums=(1,))
  return (jit(steps.prefill, draft_depth=draft_depth),
          jit(steps.decode_steps, num_steps=decode_steps, draft_depth=draft_depth))


class _Slot:
  def __init__(self, request: Request, request_id: str):
    self.request, self.id = request, request_id
    self.prompt = [int(t) for t in request.prompt]
    self.prefilled = 0  # prompt tokens in the cache
    self.cached = 0  # tokens in the cache
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.versions: list[int] = []
    self.routes: list[np.ndarray] = []  # [n, Y, K] blocks

  @property
  def decoding(self) -> bool:
    return self.prefilled == len(self.prompt)


@dataclasses.dataclass
class _Resident:
  """What a free slot's cache still holds: entries for `tokens` (their routes [n, Y, K])."""
  tokens: np.ndarray  # int32 [n]
  routes: np.ndarray  # uint16 [n, Y, K]
  finished_at: int  # engine step, for least-recently-used eviction


_GREEDY = SamplingParams(temperature=0.0)


class Engine:
  """See the module docstring. Not thread-safe except `update_weights` (c2/infer/server.py runs
  the engine on one thread)."""

  def __init__(self, cfg: ModelConfig, params, *, slots: int = 8, capacity: int = 2048,
               prefill_chunk: int = 128, prefill_rows: int = 1, draft_depth: int = 0,
               cache_dtype=None, mesh: Optional[jax.sharding.Mesh] = None,
               detokenize: Optional[Callable[[list[int]], str]] = None, version: int = 0,
               scan_layers: bool = False, prefix_cache: bool = False, decode_steps: int = 4,
               cache_windows: Optional[int] = None):
    if draft_depth and not cfg.mtp_depth:
      raise ValueError("draft_depth > 0 needs MTP modules (ModelConfig.mtp_depth >= 1)")
    if decode_steps < 1:
      raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    # Unrolled layers by default (one module and one cache array per layer), measured better on
    # both backends: XLA:CPU copies each layer's slice of stacked weights every step (most of the
    # tiny model's batch-1 step), and XLA:TPU copies the whole stacked cache around the layer scan
    # (full kimi-k2.5, 512 x 128k on v5p-128: 40 GiB of temporaries scanned, 6.8 unrolled). The
    # scan compiles faster (68 s vs 281 s there): scan_layers=True trades memory for that.
    # Attention over the smallest of 4 nested prefixes of the cache that holds every live
    # sequence (ModelConfig.cache_windows); with a mesh, where the length axis may be sharded, the
    # whole cache unless asked.
    if cache_windows is None:
      cache_windows = 4 if mesh is None else 0
    cfg = cfg.replace(scan_layers=scan_layers, cache_windows=cache_windows)
    self.cfg, self.mesh, self.detokenize = cfg, mesh, detokenize
    self.slots, self.capacity, self.draft_depth = slots, capacity, draft_depth
    self.decode_steps = decode_steps
    self.prefill_chunk, self.prefill_rows = prefill_chunk, prefill_rows
    self.params, self.version = self._place(params), version
    self.cache = cache_lib.allocate(cfg, slots, capacity, draft_depth, cache_dtype, mesh)
    if mesh is None:  # committed like the steps' outputs, so the first step's compile is reused
      self.cache = jax.device_put(self.cache, jax.devices()[0])
    self._prefill, self._decode = _jitted_steps(cfg, draft_depth, decode_steps)
    self._queue: collections.deque = collections.deque()
    self._active: list[Optional[_Slot]] = [None] * slots
    self._pending_tokens = np.zeros(slots, np.int32)  # last emitted token per slot
    self._new_weights = None
    self._lock = threading.Lock()
    self._ids = itertools.count()
    self.stats = collections.Counter()
    self._sampling_memo: dict = {}  # the rows' slots -> their sampling arrays
    self.prefix_cache = prefix_cache
    self._resident: list[Optional[_Resident]] = [None] * slots
    self._steps = 0

  # ---------------------------------------------------------------------------------- public API
  def submit(self, request: Request) -> str:
    request_id = request.id or f"req-{next(self._ids)}"
    self._queue.append((request, request_id))
    return request_id

  @property
  def has_work(self) -> bool:
    return bool(self._queue) or any(s is not None for s in self._active)

  def update_weights(self, params, version: int) -> None:
    """Takes effect at the next step boundary; sequences in flight continue on the new weights
    with their caches kept (tokens then carry the new version)."""
    with self._lock:
      self._new_weights = (params, version)

  def generate(self, requests: Iterable[Request]) -> list[Result]:
    ids = [self.submit(r) for r in requests]
    done = {}
    while len(done) < len(ids):
      for event in self.step():
        if event.result is not None:
          done[event.request_id] = event.result
    return [done[i] for i in ids]

  def stream(self, request: Request) -> Iterator[TokenEvent]:
    """Yields this request's events as they come (other requests keep being served)."""
    request_id = self.submit(request)
    while True:
      for event in self.step():
        if event.request_id == request_id:
          yield event
          if event.result is not None:
            return

  def step(self) -> list[TokenEvent]:
    """One scheduling iteration; returns the events it produced."""
    self._take_new_weights()
    self._steps += 1
    events = self._admit()
    with self._context():
      events += self._prefill_step()
      events += self._decode_step()
    return events

  # ----------------------------------------------------------------------------------- internals
  def _context(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _place(self, params):
    """Stacked params (as trained) -> this engine's layout and devices."""
    if not self.cfg.scan_layers:
      params = model.unstack_layers(params)
    if self.mesh is None:
      return params
    return jax.device_put(params, model.param_shardings(self.cfg, self.mesh))

  def _take_new_weights(self) -> None:
    with self._lock:
      update, self._new_weights = self._new_weights, None
    if update is not None:
      self.params, self.version = self._place(update[0]), int(update[1])
      self.stats["weight_updates"] += 1
      self._resident = [None] * self.slots  # entries of the old weights: never reused

  def _reject(self, request: Request, request_id: str, message: str) -> TokenEvent:
    result = Result(request_id, list(request.prompt), [], [], [], self._no_routes(), "error",
                    error=message)
    return TokenEvent(request_id, [], [], [], result)

  def _no_routes(self) -> np.ndarray:
    return np.zeros((0, self.cfg.num_moe_layers, self.cfg.experts_per_token), np.uint16)

  def _admit(self) -> list[TokenEvent]:
    events = []
    while self._queue and None in self._active:
      request, request_id = self._queue.popleft()
      prompt = list(request.prompt)
      if not prompt:
        events.append(self._reject(request, request_id, "the prompt is empty"))
      elif len(prompt) >= self.capacity:
        events.append(self._reject(request, request_id, (
            f"the prompt has {len(prompt)} tokens; this engine's context is {self.capacity} "
            f"tokens per sequence (prompt + completion): shorten the prompt or raise capacity")))
      elif min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
        events.append(self._reject(request, request_id, (
            f"prompt token ids must be in [0, {self.cfg.vocab_size}); got {min(prompt)}.."
            f"{max(prompt)}")))
      else:
        index, reused = self._choose_slot(prompt)
        slot = _Slot(request, request_id)
        if reused:
          slot.prefilled = slot.cached = reused
          slot.routes.append(self._resident[index].routes[:reused])
        self._resident[index] = None
        self._active[index] = slot
        self.stats["prompt_tokens"] += len(prompt)
        self.stats["prefix_reused_tokens"] += reused
    return events

  def _choose_slot(self, prompt: list[int]) -> tuple[int, int]:
    """(free slot, prompt tokens whose cache entries it already holds): the longest reusable
    prefix, else the slot holding nothing or the least recently used."""
    free = [i for i, s in enumerate(self._active) if s is None]
    best, best_reused = None, 0
    if self.prefix_cache:
      ids = np.asarray(prompt, np.int32)
      for i in free:
        resident = self._resident[i]
        if resident is None:
          continue
        n = min(len(resident.tokens), len(ids))
        differ = np.flatnonzero(resident.tokens[:n] != ids[:n])
        common = int(differ[0]) if len(differ) else n
        # The drafter's entry at position t was made with token t + 1, and lags the trunk by up
        # to draft_depth + 1 positions; at least one prompt token is fed to get the first logits.
        usable = common - 1 if self.draft_depth else common
        usable = min(usable, len(resident.tokens) - (self.draft_depth + 1 if self.draft_depth
                                                     else 0), len(prompt) - 1)
        if usable > best_reused:
          best, best_reused = i, usable
    if best is None:
      best = min(free, key=lambda i: -1 if self._resident[i] is None
                 else self._resident[i].finished_at)
    return best, best_reused

  def _sampling(self, slots: Sequence[Optional[_Slot]]) -> dict:
    """Per-row sampling arrays, on the device; rebuilt only when the rows' requests change.
    Empty rows are greedy so that an all-greedy batch takes the steps' greedy shortcut."""
    key = tuple(slots)  # hashed by identity; held, so a finished slot's id is never reused
    if key not in self._sampling_memo:
      if len(self._sampling_memo) >= 4:  # the prefill rows and the decode rows, then older
        self._sampling_memo.clear()
      params = [s.request.sampling if s is not None else _GREEDY for s in slots]
      arrays = {"temperature": np.array([p.temperature for p in params], np.float32),
                "top_k": np.array([p.top_k for p in params], np.int32),
                "top_p": np.array([p.top_p for p in params], np.float32),
                "seed": np.array([p.seed for p in params], np.uint32)}
      self._sampling_memo[key] = jax.device_put(arrays) if self.mesh is None else arrays
    return self._sampling_memo[key]

  def _prefill_step(self) -> list[TokenEvent]:
    chosen = [i for i, s in enumerate(self._active) if s is not None and not s.decoding]
    chosen = chosen[:self.prefill_rows]
    if not chosen:
      return []
    p, t = self.prefill_rows, self.prefill_chunk
    tokens, following = np.zeros((p, t), np.int32), np.zeros(p, np.int32)
    rows, starts, counts = np.zeros(p, np.int32), np.zeros(p, np.int32), np.zeros(p, np.int32)
    is_last = np.zeros(p, bool)
    for r, i in enumerate(chosen):
      slot = self._active[i]
      chunk = slot.prompt[slot.prefilled:slot.prefilled + t]
      tokens[r, :len(chunk)] = chunk
      rows[r], starts[r], counts[r] = i, slot.prefilled, len(chunk)
      end = slot.prefilled + len(chunk)
      is_last[r] = end == len(slot.prompt)
      following[r] = slot.prompt[end] if end < len(slot.prompt) else 0
    sampling = self._sampling([self._active[i] for i in chosen] + [None] * (p - len(chosen)))
    self.cache, first, logprob, routes = self._prefill(
        self.params, self.cache, tokens, rows, starts, counts, following, is_last, sampling)
    first, logprob, routes = jax.device_get((first, logprob, routes))
    self.stats["prefill_steps"] += 1
    events = []
    for r, i in enumerate(chosen):
      slot = self._active[i]
      slot.routes.append(self._route_block(routes, r, counts[r]))
      slot.prefilled += int(counts[r])
      slot.cached = slot.prefilled
      if is_last[r]:
        events += self._emit(i, [int(first[r])], [float(logprob[r])])
    return events

  def _route_block(self, routes: np.ndarray, row: int, count: int) -> np.ndarray:
    """routes [Y, rows, T, K] -> [count, Y, K] uint16 for one row's first `count` tokens."""
    if routes.ndim < 4:  # no MoE layers
      return np.zeros((count, 0, self.cfg.experts_per_token), np.uint16)
    return routes[:, row, :count].transpose(1, 0, 2).astype(np.uint16)

  def _decode_step(self) -> list[TokenEvent]:
    # No capacity check is needed here: _emit ends a sequence at `capacity` tokens, and writes
    # past the end are dropped (a speculative step's queries see their own chunk's keys
    # directly, so the tokens it emits within capacity are still exact).
    active = np.array([s is not None and s.decoding for s in self._active])
    if not active.any():
      return []
    self.cache, *outputs = self._decode(self.params, self.cache, self._pending_tokens, active,
                                        self._sampling(self._active))
    counts, emitted, logprobs, routes = jax.device_get(outputs)  # [N, S], [N, S, W] x2, routes
    self.stats["decode_steps"] += self.decode_steps
    events = []
    for i in np.flatnonzero(active):
      # This row's tokens of all S steps, in order: the first counts[s] of step s.
      valid = np.arange(emitted.shape[2])[None, :] < counts[i][:, None]  # [S, W]
      block = (routes[:, i].transpose(1, 2, 0, 3)[valid] if routes.ndim == 5 else
               np.zeros((int(counts[i].sum()), 0, self.cfg.experts_per_token)))
      self._active[i].routes.append(block.astype(np.uint16))  # [fed tokens, Y, K]
      self._active[i].cached += int(counts[i].sum())
      event = self._emit(i, emitted[i][valid].tolist(), logprobs[i][valid].tolist())[0]
      # Per-step statistics over the steps whose tokens were kept (not those run past a stop).
      ran = int(np.searchsorted(np.cumsum(counts[i]), len(event.token_ids))) + 1
      self.stats["decode_rows"] += ran
      for j in range(self.draft_depth):
        self.stats[f"accepted_depth_{j + 1}"] += int(np.sum(counts[i, :ran] > j + 1))
      events.append(event)
    return events

  def _emit(self, index: int, tokens: list[int], logprobs: list[float]) -> list[TokenEvent]:
    """Appends emitted tokens to a slot, applying stop conditions; may finish the slot."""
    slot = self._active[index]
    sampling = slot.request.sampling
    kept, reason, stop = [], None, None
    for token in tokens:
      kept.append(token)
      slot.tokens.append(token)
      if token in sampling.stop_token_ids:
        reason, stop = "stop", token
      elif sampling.stop and self.detokenize is not None:
        text = self.detokenize(slot.tokens)
        stop = next((s for s in sampling.stop if s in text), None)
        reason = "stop" if stop is not None else None
      if reason is None and len(slot.tokens) >= min(sampling.max_new_tokens,
                                                    self.capacity - len(slot.prompt)):
        reason = "length"
      if reason:
        break
    # Tokens emitted past a stop were fed to the model as drafts: drop their routes too.
    if len(kept) < len(tokens):
      slot.routes[-1] = slot.routes[-1][:len(kept)]
    n = len(kept)
    slot.logprobs += logprobs[:n]
    slot.versions += [self.version] * n
    self._pending_tokens[index] = kept[-1]
    self.stats["tokens"] += n
    event = TokenEvent(slot.id, kept, logprobs[:n], [self.version] * n)
    if reason:
      event.result = self._finish(index, reason, stop)
    return [event]

  def _finish(self, index: int, reason: str, stop=None) -> Result:
    slot = self._active[index]
    self._active[index] = None
    routes = np.concatenate(slot.routes) if slot.routes else self._no_routes()
    fed = len(slot.prompt) + len(slot.tokens) - 1
    if self.prefix_cache:  # entries of every fed token (later ones: drafts past a stop, unused)
      self._resident[index] = _Resident(np.asarray(slot.prompt + slot.tokens[:-1], np.int32),
                                        routes[:fed], self._steps)
    return Result(slot.id, slot.prompt, slot.tokens, slot.logprobs, slot.versions, routes[:fed],
                  reason, stop)
