"""The engine's device steps: chunked prefill, plain decode, speculative decode. Pure functions.

Glossary: N slots, P prefill rows, T chunk length, V vocabulary, D draft depth, W = D + 1,
Y MoE layers, K experts per token, S decode steps per call.

Each takes (params, cache, ...) and returns the new cache plus what the host needs: sampled
tokens, their float32 log-probs and the routes chosen at every MoE layer for every token fed in
(router replay). `sampling` is a dict of per-row arrays: temperature, top_k, top_p, seed.
The engine jits them with the cache donated, so caches are updated in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from c2 import model
from c2.infer import sampling as sampling_lib
from c2.infer import speculative
from c2.infer.cache import EngineCache
from c2.model.config import ModelConfig


def _logits(cfg: ModelConfig, params, hidden: jax.Array) -> jax.Array:
  """hidden [..., D] -> float32 logits [..., V]."""
  return jnp.einsum("...D,DV->...V", hidden.astype(jnp.float32),
                    model.head_kernel(cfg, params).astype(jnp.float32))


def _dist(logits: jax.Array, sampling: dict) -> jax.Array:
  """Sampling log-probs for logits [N, V] or [N, T, V] with per-row settings."""
  shape = logits.shape
  rows = lambda a: jnp.broadcast_to(a.reshape((shape[0],) + (1,) * (len(shape) - 2)),
                                    shape[:-1]).reshape(-1)
  flat = logits.reshape(-1, shape[-1])
  temperature = rows(sampling["temperature"])
  dist = sampling_lib.sampling_logprobs(flat, temperature, rows(sampling["top_k"]),
                                        rows(sampling["top_p"]))
  reported = sampling_lib.reported_logprobs(flat, dist, temperature)
  return dist.reshape(shape), reported.reshape(shape)


def _draw(dist: jax.Array, sampling: dict, positions: jax.Array, stream: int) -> jax.Array:
  return sampling_lib.draw_tokens(dist, sampling["temperature"], sampling["seed"], positions,
                                  stream)


def _pick(logprobs: jax.Array, tokens: jax.Array) -> jax.Array:
  return jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]


def _routes(out: dict) -> jax.Array:
  """[Y, B, T, K] int32 routes of the trunk's MoE layers (empty Y when the model has none)."""
  return out["aux"]["moe"]["routes"] if "moe" in out["aux"] else jnp.zeros((0,), jnp.int32)


def prefill(params, cache: EngineCache, tokens: jax.Array, rows: jax.Array, starts: jax.Array,
            counts: jax.Array, following: jax.Array, is_last: jax.Array, sampling: dict, *,
            cfg: ModelConfig, draft_depth: int):
  """One prompt chunk for P rows: tokens [P, T] at positions starts + t, the first counts [P] of
  them real; `following` [P] the prompt token after the chunk (for the MTP cache); is_last [P]:
  the chunk ends its prompt, so the token drawn from its last position starts the completion.
  Rows with count 0 are padding (their slot is untouched).
  -> (cache, first_token [P], logprob [P], routes [Y, P, T, K])
  """
  p, t = tokens.shape
  index = jnp.arange(t)[None, :]
  valid = index < counts[:, None]  # [P, T]
  positions = starts[:, None] + index
  out = model.forward(cfg, params, tokens, valid.astype(jnp.int32), positions, with_mtp=False,
                      cache=(cache.trunk_stacks, rows, starts))
  last = jnp.maximum(counts - 1, 0)
  last_hidden = jnp.take_along_axis(out["hidden"], last[:, None, None], axis=1)[:, 0]  # [P, D]
  dist, reported = _dist(_logits(cfg, params, last_hidden), sampling)
  first = _draw(dist, sampling, starts + counts, sampling_lib.SAMPLE)
  real = counts > 0
  stacks = {**cache.stacks, **out["kv_cache"]}
  # Padding rows may name a real row's slot: send their writes out of bounds (dropped), or the
  # scatter could keep the padding's stale value for that slot.
  targets = jnp.where(real, rows, cache.lengths.shape[0])
  lengths = cache.lengths.at[targets].set(starts + counts, mode="drop")
  cache = cache.replace(stacks=stacks, lengths=lengths)
  if draft_depth:
    cache = _prefill_drafter(cfg, params, cache, tokens, out["trunk_hidden"], rows, targets, starts,
                             counts, following, is_last, first, valid)
  return cache, first, _pick(reported, first), _routes(out)


def _prefill_drafter(cfg, params, cache, tokens, trunk_hidden, rows, targets, starts, counts,
                     following, is_last, first, valid):
  """MTP cache for a prompt chunk: position t needs token t + 1, known for all but a final
  chunk's last position, which waits (pending) for the next speculative step with `first`."""
  p, t = tokens.shape
  last = jnp.maximum(counts - 1, 0)
  after_last = jnp.where(is_last, first, following)  # [P]
  next_tokens = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
  next_tokens = next_tokens.at[jnp.arange(p), last].set(after_last)
  mtp_valid = valid & ~(is_last[:, None] & (jnp.arange(t)[None, :] == last[:, None]))
  out = model.mtp_step(cfg, params, 0, trunk_hidden, next_tokens, mtp_valid.astype(jnp.int32),
                       starts[:, None] + jnp.arange(t)[None, :], cache.stacks["mtp"], rows, starts)
  mtp_count = mtp_valid.sum(-1).astype(jnp.int32)
  pending_hidden = jnp.zeros((p,) + cache.pending_hidden.shape[1:], cache.pending_hidden.dtype).at[
      :, 0].set(jnp.take_along_axis(trunk_hidden, last[:, None, None], axis=1)[:, 0].astype(
          cache.pending_hidden.dtype))
  pending_tokens = jnp.zeros((p,) + cache.pending_tokens.shape[1:], jnp.int32).at[:, 0].set(first)
  put = lambda old, new: old.at[targets].set(new, mode="drop")  # padding rows: out of bounds
  return cache.replace(
      stacks={**cache.stacks, "mtp": out["kv_cache"]},
      mtp_lengths=put(cache.mtp_lengths, starts + mtp_count),
      pending_hidden=put(cache.pending_hidden, pending_hidden),
      pending_tokens=put(cache.pending_tokens, pending_tokens),
      pending_count=put(cache.pending_count, is_last.astype(jnp.int32)))


def decode(params, cache: EngineCache, tokens: jax.Array, active: jax.Array, sampling: dict, *,
           cfg: ModelConfig):
  """One token for every active slot: tokens [N] (the last sampled, not yet cached).
  -> (cache, next_tokens [N], logprobs [N], routes [Y, N, 1, K] of the fed tokens)"""
  out = model.forward(cfg, params, tokens[:, None], active[:, None].astype(jnp.int32),
                      cache.lengths[:, None], with_mtp=False,
                      cache=(cache.trunk_stacks, None, cache.lengths))
  dist, reported = _dist(_logits(cfg, params, out["hidden"][:, 0]), sampling)
  drawn = _draw(dist, sampling, cache.lengths + 1, sampling_lib.SAMPLE)
  cache = cache.replace(stacks={**cache.stacks, **out["kv_cache"]},
                        lengths=cache.lengths + active.astype(jnp.int32))
  return cache, drawn, _pick(reported, drawn), _routes(out)


def speculate(params, cache: EngineCache, tokens: jax.Array, active: jax.Array, sampling: dict, *,
              cfg: ModelConfig, draft_depth: int):
  """Draft `draft_depth` tokens with the MTP module, verify them in one trunk forward, accept by
  the rejection rule (c2.infer.speculative). tokens [N]: the last sampled token per slot.
  -> (cache, num_accepted [N], tokens [N, W] (the first num_accepted + 1 are emitted),
      logprobs [N, W], routes [Y, N, W, K] of the fed tokens [last, d_1..d_D])"""
  n, w = tokens.shape[0], draft_depth + 1
  n_cached = cache.lengths
  stack = cache.stacks["mtp"]
  # 1. Fold the pending positions into the MTP cache; the last one drafts d_1.
  pending = (jnp.arange(w)[None, :] < cache.pending_count[:, None]) & active[:, None]
  out = model.mtp_step(cfg, params, 0, cache.pending_hidden, cache.pending_tokens,
                       pending.astype(jnp.int32), cache.mtp_lengths[:, None] + jnp.arange(w),
                       stack, None, cache.mtp_lengths)
  stack = out["kv_cache"]
  mtp_lengths = cache.mtp_lengths + jnp.where(active, cache.pending_count, 0)
  last = jnp.maximum(cache.pending_count - 1, 0)[:, None, None]
  h = jnp.take_along_axis(out["h"], last, axis=1)  # [N, 1, D]
  hidden = jnp.take_along_axis(out["hidden"], last, axis=1)[:, 0]
  drafts, draft_dists = [], []
  for j in range(draft_depth):
    if j:  # 2. Further drafts: the module again, on its own hidden state and the last draft.
      out = model.mtp_step(cfg, params, 0, h, drafts[-1][:, None], active[:, None].astype(jnp.int32),
                           (n_cached + j - 1)[:, None], stack, None, mtp_lengths + j - 1)
      stack, h, hidden = out["kv_cache"], out["h"], out["hidden"][:, 0]
    dist, _ = _dist(_logits(cfg, params, hidden), sampling)
    drafts.append(_draw(dist, sampling, n_cached + 1 + j, sampling_lib.DRAFT))
    draft_dists.append(dist)
  drafts_arr = jnp.stack(drafts, axis=1)  # [N, D]
  # 3. Verify [last, d_1..d_D] in one trunk forward.
  fed = jnp.concatenate([tokens[:, None], drafts_arr], axis=1)  # [N, W]
  out = model.forward(cfg, params, fed, jnp.broadcast_to(active[:, None], (n, w)).astype(jnp.int32),
                      n_cached[:, None] + jnp.arange(w), with_mtp=False,
                      cache=(cache.trunk_stacks, None, n_cached))
  target, reported = _dist(_logits(cfg, params, out["hidden"]), sampling)  # [N, W, V]
  num_accepted, emitted = speculative.accept(target, jnp.stack(draft_dists, axis=1), drafts_arr,
                                             sampling["seed"], n_cached + 1,
                                             sampling["temperature"])
  grow = jnp.where(active, num_accepted + 1, 0)
  keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  cache = cache.replace(
      stacks={**cache.stacks, **out["kv_cache"], "mtp": stack},
      lengths=n_cached + grow, mtp_lengths=mtp_lengths,
      pending_hidden=keep(out["trunk_hidden"].astype(cache.pending_hidden.dtype),
                          cache.pending_hidden),
      pending_tokens=keep(emitted, cache.pending_tokens),
      pending_count=keep(num_accepted + 1, cache.pending_count))
  return cache, num_accepted, emitted, _pick(reported, emitted), _routes(out)


def decode_steps(params, cache: EngineCache, tokens: jax.Array, active: jax.Array, sampling: dict,
                 *, cfg: ModelConfig, num_steps: int, draft_depth: int):
  """`num_steps` decode steps in one call (plain, or speculative with `draft_depth` drafts), each
  feeding the last token the one before emitted. What a call costs the host (dispatch, the
  transfer back, bookkeeping) is then paid once per S steps: on CPU it was a third of a batch-1
  step. A row that meets a stop condition mid-call runs on to the end of it; the host drops what
  it emitted after the stop (as speculative tokens past a stop), and the slot is freed.
  -> (cache, counts [N, S] tokens emitted per step (accepted drafts + 1), tokens [N, S, W],
      logprobs [N, S, W], routes [Y, N, S, W, K] of the fed tokens (the first counts of each))"""
  def one_step(carry, _):
    cache, last = carry
    if draft_depth:
      cache, accepted, emitted, logprobs, routes = speculate(
          params, cache, last, active, sampling, cfg=cfg, draft_depth=draft_depth)
    else:
      cache, drawn, logprob, routes = decode(params, cache, last, active, sampling, cfg=cfg)
      accepted, emitted, logprobs = jnp.zeros_like(drawn), drawn[:, None], logprob[:, None]
    last = jnp.take_along_axis(emitted, accepted[:, None], axis=1)[:, 0]
    return (cache, last), (accepted + 1, emitted, logprobs, routes)

  (cache, _), (counts, emitted, logprobs, routes) = jax.lax.scan(
      one_step, (cache, tokens), None, length=num_steps)
  routes = jnp.moveaxis(routes, 0, 2) if routes.ndim == 5 else routes  # [S, Y, N, W, K] -> Y N S
  return cache, counts.T, jnp.swapaxes(emitted, 0, 1), jnp.swapaxes(logprobs, 0, 1), routes
