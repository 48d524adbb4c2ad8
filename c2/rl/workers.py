"""What an engine worker and an environment worker are, independent of where they run.

    spec = WorkerSpec(model=cfg, store_dir=..., tokenizer=..., env=env_config, ...)
    engine = EngineHost(spec, version)        # an Engine on its own thread, weights from the store
    result = engine.generate(request)         # blocking; any thread
    engine.load_version(7)                    # rebuilt from the store's chain, swapped in between
                                              # decode steps; sequences in flight continue
    rollout = run_task(spec, rollout_spec, task, engine.generate)   # one environment rollout

Both backends (c2/rl/backends.py: threads; c2/rl/ray_backend.py: Ray actors) build exactly these
objects from the same picklable WorkerSpec, so the rollout code is one code path.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Optional

from c2.data.tokenizer import Tokenizer, load_tokenizer
from c2.envs.environment import CodingEnv, EnvConfig
from c2.envs.tasks import Task
from c2.infer.engine import Engine, Request, Result
from c2.infer.sampling import SamplingParams
from c2.infer.server import EngineWorker
from c2.model.config import ModelConfig
from c2.rl import publication
from c2.rl.rollout import Generate, Rollout, RolloutError, RolloutSpec, run_rollout


class WorkerDiedError(RolloutError):
  """The worker running a rollout (or serving its engine requests) died."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
  """Everything a worker needs, picklable (plain values; the tokenizer by path)."""
  model: ModelConfig
  store_dir: str  # c2.rl.publication.WeightStore the engines read versions from
  tokenizer_path: str
  env: EnvConfig
  sampling: SamplingParams
  max_context: int
  engine_slots: int = 16
  prefill_chunk: int = 256
  draft_depth: int = 0  # MTP speculative decoding in rollouts (0: plain decoding)
  prefix_cache: bool = True  # a turn prefills only what the previous turn's slot lacks
  decode_steps: int = 4  # decode steps per engine call


def load_worker_tokenizer(spec: WorkerSpec) -> Tokenizer:
  return load_tokenizer(spec.tokenizer_path)


class EngineHost:
  """An Engine served by one thread (c2.infer.server.EngineWorker), its weights read from the
  weight store by version. `kill()` makes it die like a crashed worker: every request in flight
  fails with WorkerDiedError and later requests are refused."""

  def __init__(self, spec: WorkerSpec, version: int):
    self.spec = spec
    self.store = publication.WeightStore(spec.store_dir)
    params = self.store.load(version)
    self.engine = Engine(spec.model, params, slots=spec.engine_slots, capacity=spec.max_context,
                         prefill_chunk=spec.prefill_chunk, draft_depth=spec.draft_depth,
                         version=version, prefix_cache=spec.prefix_cache,
                         decode_steps=spec.decode_steps)
    self.worker = EngineWorker(self.engine)
    self.dead = threading.Event()
    self._loading = threading.Lock()
    self.requested_version = version
    self.started = time.perf_counter()

  @property
  def version(self) -> int:
    """The version of the next token sampled. The engine takes weights handed over at the start
    of a step and steps only for requests, so an idle one samples next with the last version
    handed over: reporting its old one would stall whoever waits for the new version before
    submitting (the coordinator's staleness bound, the learner's evaluation)."""
    if self.engine.has_work:
      return self.engine.version
    return max(self.engine.version, self.requested_version)

  def generate(self, request: Request) -> Result:
    if self.dead.is_set():
      raise WorkerDiedError("the engine worker is dead")
    outbox = self.worker.submit(request)
    while True:
      try:
        event = outbox.get(timeout=0.2)
      except queue.Empty:
        if self.dead.is_set():
          raise WorkerDiedError("the engine worker died during the request") from None
        continue
      if event.result is not None:
        if self.dead.is_set():
          raise WorkerDiedError("the engine worker died during the request")
        return event.result

  def load_version(self, version: int) -> None:
    """Rebuilds `version` from the store and hands it to the engine (taken at its next step)."""
    with self._loading:
      if version <= self.requested_version:
        return
      params = self.store.load(version)
      self.engine.update_weights(params, version)
      self.requested_version = version

  def stats(self) -> dict:
    s = self.engine.stats
    elapsed = max(time.perf_counter() - self.started, 1e-9)
    out = {"engine/tokens_per_sec": s["tokens"] / elapsed, "engine/version": self.version,
           # prompt tokens whose cache entries a previous turn left (not prefilled again)
           "engine/prefix_reuse": s["prefix_reused_tokens"] / max(s["prompt_tokens"], 1),
           # slots decoding per decode step, over the slots: how full the engine's batch is
           "engine/decode_occupancy": s["decode_rows"] / max(s["decode_steps"] *
                                                             self.spec.engine_slots, 1)}
    for depth in range(1, self.spec.draft_depth + 1):  # per-depth acceptance of the MTP drafts
      out[f"engine/mtp_acceptance_{depth}"] = (s[f"accepted_depth_{depth}"] /
                                               max(s["decode_rows"], 1))
    return out

  def kill(self) -> None:
    self.dead.set()
    self.worker.close()

  def close(self) -> None:
    self.worker.close()


def run_task(spec: WorkerSpec, rollout: RolloutSpec, task: Task, generate: Generate,
             tokenizer: Optional[Tokenizer] = None) -> Rollout:
  """One rollout of `task` in a fresh sandboxed environment."""
  tokenizer = tokenizer or load_worker_tokenizer(spec)
  env = CodingEnv(task, spec.env, count_tokens=lambda text: len(tokenizer.encode(text)))
  return run_rollout(rollout, env, generate, tokenizer, spec.sampling, max_context=spec.max_context)
