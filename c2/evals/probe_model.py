"""The model as the probes see it: log-probs of token rows, and greedy completions.

    probe = ProbeModel(cfg, params, tokenizer, context=256)
    [logp] = probe.logprobs([[bos, 12, 7, 99]])   # logp[t] = log p(row[t] | row[:t]); logp[0] = 0
    [ids] = probe.complete([prompt_ids], max_new_tokens=32)   # greedy, through c2.infer.Engine

Log-probs come from the functional forward and the RL loss library's chunked head
(c2.losses.rl.token_logprobs: the [N, V] logits never exist at once), on rows padded to a fixed
length so a suite compiles once per length. Completions go through the inference engine, the
sampler RL and serving use, greedily (temperature 0), so a probe's answer is the model's argmax
continuation and the same on every run.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from c2 import model
from c2.data.tokenizer import Tokenizer
from c2.infer.engine import Engine, Request
from c2.infer.sampling import SamplingParams
from c2.losses import rl as rl_losses
from c2.model.config import ModelConfig

_HEAD_CHUNK = 1024  # tokens per head chunk of the log-prob pass


@functools.partial(jax.jit, static_argnums=(0,))
def row_logprobs(cfg: ModelConfig, params, tokens: jax.Array, valid: jax.Array) -> jax.Array:
  """tokens [B, T] int32, valid [B, T] bool (a prefix of each row) -> float32 [B, T] with
  out[:, t] = log p(tokens[:, t] | tokens[:, :t]) for t >= 1; 0 at t = 0 and on padding."""
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden = model.forward(cfg, params, tokens, valid.astype(jnp.int32), positions,
                         with_mtp=False)["hidden"]  # [B, T, D]
  # Position t - 1 predicts token t: drop the last hidden state and the first token.
  logp = rl_losses.token_logprobs(hidden[:, :-1].reshape(b * (t - 1), -1),
                                  model.head_kernel(cfg, params), tokens[:, 1:].reshape(-1),
                                  _HEAD_CHUNK).reshape(b, t - 1)
  return jnp.pad(logp, ((0, 0), (1, 0))) * valid


class ProbeModel:
  """One checkpoint, ready to score and complete. `context` is the row length of `logprobs` (the
  model's trained context, usually); `capacity` the engine's tokens per sequence."""

  def __init__(self, cfg: ModelConfig, params, tokenizer: Tokenizer, *, context: int,
               batch: int = 8, capacity: Optional[int] = None, slots: int = 8):
    self.cfg, self.tokenizer = cfg, tokenizer
    self.context, self.batch, self.slots = context, batch, slots
    self.capacity = capacity or context
    self.params = jax.device_put(params)
    self._engine: Optional[Engine] = None

  def logprobs(self, rows: Sequence[Sequence[int]], length: Optional[int] = None
               ) -> list[np.ndarray]:
    """Per-row float32 log-probs (see `row_logprobs`), rows of at most `length` (default
    `context`) tokens; rows are padded to that length and run `batch` at a time."""
    length = length or self.context
    out = []
    for first in range(0, len(rows), self.batch):
      chunk = rows[first:first + self.batch]
      tokens = np.zeros((self.batch, length), np.int32)
      valid = np.zeros((self.batch, length), bool)
      for i, row in enumerate(chunk):
        if len(row) > length:
          raise ValueError(f"a row of {len(row)} tokens does not fit the probe length {length}")
        tokens[i, :len(row)] = row
        valid[i, :len(row)] = True
      logp = np.asarray(jax.device_get(row_logprobs(self.cfg, self.params, tokens, valid)))
      out += [logp[i, :len(row)] for i, row in enumerate(chunk)]
    return out

  def complete(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
               ) -> list[list[int]]:
    """Greedy continuations (token ids) of each prompt, at most max_new_tokens (one number, or
    one per prompt) and never past the engine's capacity."""
    if self._engine is None:
      self._engine = Engine(self.cfg, self.params, slots=self.slots, capacity=self.capacity)
    if isinstance(max_new_tokens, int):
      max_new_tokens = [max_new_tokens] * len(prompts)
    results = self._engine.generate([
        Request(list(p), SamplingParams(max_new_tokens=m, temperature=0.0))
        for p, m in zip(prompts, max_new_tokens)])
    for r in results:
      if r.finish_reason == "error":
        raise ValueError(f"the engine refused a probe prompt: {r.error}")
    return [r.token_ids for r in results]

  def answer_nats(self, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                  length: Optional[int] = None) -> list[float]:
    """Teacher-forced -log p(answer | prompt) in nats, per pair (the continuous companion of an
    exact-match score: it moves before the argmax answer does)."""
    rows = [list(p) + list(a) for p, a in zip(prompts, answers)]
    logps = self.logprobs(rows, length)
    return [-float(lp[len(p):].sum()) for lp, p in zip(logps, prompts)]
