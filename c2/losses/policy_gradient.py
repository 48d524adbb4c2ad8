"""The RL objective (Composer 2 report 4.2-4.3): Dr. GRPO advantages, k1 KL, truncated IS.

Glossary: B rows (one per segment), T tokens, G group size, C chains (rollouts), Z the constant
normaliser.

  A_i     = R_i - mean_{j in group(i)} R_j                  per chain, no std division (Dr. GRPO)
  A_{b,t} = A_{chain(b)} * mask_{b,t}                       every model token of every segment
  A_{b,t} <- A_{b,t} - beta * sg(logp - logp_ref)           k1 KL as detached reward shaping
  w_{b,t} = sg(min(exp(logp - logp_sampler), cap))          token-level truncated IS (optional)
  L       = -(1/Z) sum_{b,t} mask * w * A_{b,t} * logp
so dL/dlogp_{b,t} = -mask * w * A_{b,t} / Z. On-policy (w = 1) this is the score-function
gradient: the surrogate's *value* is -sum(mask * A * logp) / Z, meaningful only through its
gradient.

Z is a Python constant fixed for the run (e.g. max tokens per row * rows per step): dividing by
each batch's token count or by each sequence's length reintroduces the length bias Dr. GRPO
removes (a long rollout's tokens would each count less). Environment tokens (tool output, the
task, summary requests) carry mask 0 and get no gradient.

Self-summarised rollouts are chains of segments; the caller lays them out one row per segment
and passes `chain_of_row` [B] (the chain index of each row) so every segment gets its chain's
advantage, computed once from the chain's final reward.

The k1 placement (report 4.3): as a detached reward term it is the unbiased score-function
gradient of KL(pi || pi_ref) on-policy; differentiated as a loss ("loss") its expected gradient
is zero, kept for comparison. All functions are pure jnp; group layouts are host metadata.
"""
from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

KL_PLACEMENTS = ("reward", "loss", "none")


def group_index(group_ids: Union[np.ndarray, jax.Array]) -> np.ndarray:
  """Host-side group layout -> int [num_groups, G] row indices, each group's rows in row order.

  group_ids: [B] labels (any order, any values) or already [num_groups, G] row indices. Groups
  must all hold G rows (the report's fixed group size): a ragged layout raises ValueError.
  """
  ids = np.asarray(group_ids)
  if ids.ndim == 2:
    if sorted(ids.reshape(-1).tolist()) != list(range(ids.size)):
      raise ValueError(f"group index {ids.shape} must hold each row 0..{ids.size - 1} once")
    return ids.astype(np.int32)
  if ids.ndim != 1:
    raise ValueError(f"group_ids must be [B] labels or [num_groups, G] rows, got {ids.shape}")
  labels, counts = np.unique(ids, return_counts=True)
  if len(set(counts.tolist())) != 1:
    raise ValueError("ragged groups: sizes " + ", ".join(
        f"{label}: {count}" for label, count in zip(labels.tolist(), counts.tolist())))
  return np.stack([np.flatnonzero(ids == label) for label in labels]).astype(np.int32)


def group_advantages(rewards: jax.Array, group_ids: Union[np.ndarray, jax.Array], *,
                     scale_by_std: bool = False, eps: float = 1e-6) -> jax.Array:
  """rewards [B] float -> advantages [B] float32: R - mean(group).

  scale_by_std=True gives GRPO's (R - mean) / (std + eps) with the population std (ddof 0), for
  comparison only: in a group whose rollouts are all about equally good it blows small
  behavioural differences up to unit scale (why Dr. GRPO and the report drop it).
  """
  index = group_index(group_ids)  # [num_groups, G]
  rewards = rewards.astype(jnp.float32)
  grouped = rewards[index]  # [num_groups, G]
  centred = grouped - grouped.mean(-1, keepdims=True)
  if scale_by_std:
    centred = centred / (grouped.std(-1, keepdims=True) + eps)
  return jnp.zeros_like(rewards).at[index.reshape(-1)].set(centred.reshape(-1))


def token_advantages(advantages: jax.Array, mask: jax.Array,
                     chain_of_row: Optional[jax.Array] = None) -> jax.Array:
  """advantages [C] per chain (or [B] per row when chain_of_row is None), mask [B, T] (1 on model
  tokens, 0 on environment tokens and padding), chain_of_row [B] int -> [B, T] float32.

  Every model token of every segment row gets its chain's advantage; the rest get 0."""
  per_row = advantages if chain_of_row is None else advantages[chain_of_row]  # [B]
  return per_row.astype(jnp.float32)[:, None] * mask.astype(jnp.float32)


def masked_percentile(values: jax.Array, mask: jax.Array, q: float) -> jax.Array:
  """The q-th percentile (0..100, linear interpolation as np.percentile) of values where mask;
  0 when nothing is masked in. values, mask [...] -> float32 []."""
  flat = values.reshape(-1).astype(jnp.float32)
  keep = mask.reshape(-1) > 0
  count = jnp.sum(keep)
  # Masked-out values sort to the front; the kept ones fill the last `count` places.
  ordered = jnp.sort(jnp.where(keep, flat, -jnp.inf))
  offset = (q / 100.0) * jnp.maximum(count - 1, 0).astype(jnp.float32)  # within the kept run
  lo = (flat.size - count) + jnp.floor(offset).astype(jnp.int32)  # integer part kept exact
  hi = jnp.minimum(lo + 1, flat.size - 1)
  frac = offset - jnp.floor(offset)
  lo_value, hi_value = ordered[lo], ordered[hi]
  hi_value = jnp.where(frac > 0, hi_value, lo_value)  # never read a -inf neighbour when exact
  return jnp.where(count > 0, lo_value + frac * (hi_value - lo_value), 0.0)


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def policy_gradient_loss(logp: jax.Array, sampler_logp: jax.Array, advantages: jax.Array,
                         mask: jax.Array, *, normalizer: float,
                         ref_logp: Optional[jax.Array] = None, kl_coef: float = 0.0,
                         kl_placement: str = "reward",
                         is_cap: Optional[float] = None,
                         pg_mask: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
  """The Dr. GRPO surrogate with k1 KL and optional truncated IS -> (loss [], metrics).

  Args:
    logp: [B, T] float32, the trainer's log-probs of the taken tokens (differentiated).
    sampler_logp: [B, T], the inference engine's log-probs of the same tokens (data).
    advantages: [B, T] per-token advantages (`token_advantages`), data.
    mask: [B, T], 1 on model tokens; environment tokens and padding 0.
    normalizer: Z, a Python number fixed for the run (not this batch's token count).
    ref_logp: [B, T] reference-policy log-probs; needed when kl_coef != 0 and placement != none.
    kl_coef: beta. kl_placement: "reward" (detached shaping of A, default), "loss" (beta * k1
      added to the loss), "none".
    is_cap: C of w = sg(min(pi_train / pi_sampler, C)); None disables (w = 1).
    pg_mask: [B, T] optional, data: 0 drops a model token from the policy-gradient term only (the
      KL loss and the metrics still count it); e.g. positions of low entropy (c2.losses.rl).

  Metrics (means over masked tokens): kl (k1, when ref_logp is given), mismatch_mean and
  mismatch_p99 of |logp - sampler_logp|, is_clipped_fraction (ratio > cap), is_weight_mean,
  advantage_mean (the advantages passed in), tokens, pg_loss, kl_loss, and pg_token_fraction
  (model tokens the policy gradient kept) with a pg_mask.
  """
  if isinstance(normalizer, (jax.Array, np.ndarray)) or not normalizer > 0:
    raise TypeError(f"normalizer must be a positive Python number fixed for the run, got "
                    f"{normalizer!r}")
  if kl_placement not in KL_PLACEMENTS:
    raise ValueError(f"kl_placement={kl_placement!r}, expected one of {KL_PLACEMENTS}")
  use_kl = kl_placement != "none" and kl_coef != 0.0
  if use_kl and ref_logp is None:
    raise ValueError(f"kl_placement={kl_placement!r} with kl_coef={kl_coef} needs ref_logp")
  logp = logp.astype(jnp.float32)
  mask = mask.astype(jnp.float32)
  data = lambda a: jax.lax.stop_gradient(a.astype(jnp.float32))
  sampler_logp, advantages = data(sampler_logp), data(advantages)

  log_ratio = jax.lax.stop_gradient(logp) - sampler_logp  # [B, T] trainer vs sampler
  weight = jnp.ones_like(logp)
  clipped = jnp.zeros_like(logp)
  if is_cap is not None:
    ratio = jnp.exp(log_ratio)
    weight = jnp.minimum(ratio, is_cap)  # detached: built from stop_gradient(logp)
    clipped = (ratio > is_cap).astype(jnp.float32)

  k1 = None if ref_logp is None else logp - data(ref_logp)  # [B, T], log pi - log pi_ref
  shaped = advantages
  if use_kl and kl_placement == "reward":
    shaped = advantages - kl_coef * jax.lax.stop_gradient(k1)
  pg_weight = mask if pg_mask is None else mask * data(pg_mask)
  pg_loss = -jnp.sum(pg_weight * weight * shaped * logp) / normalizer
  kl_loss = jnp.zeros((), jnp.float32)
  if use_kl and kl_placement == "loss":
    kl_loss = kl_coef * jnp.sum(mask * k1) / normalizer
  loss = pg_loss + kl_loss

  mismatch = jnp.abs(log_ratio)
  metrics = {
      "pg_loss": pg_loss,
      "kl_loss": kl_loss,
      "mismatch_mean": _masked_mean(mismatch, mask),
      "mismatch_p99": masked_percentile(mismatch, mask, 99.0),
      "is_clipped_fraction": _masked_mean(clipped, mask),
      "is_weight_mean": _masked_mean(weight, mask),
      "advantage_mean": _masked_mean(advantages, mask),
      "tokens": jnp.sum(mask),
  }
  if k1 is not None:
    metrics["kl"] = _masked_mean(jax.lax.stop_gradient(k1), mask)
  if pg_mask is not None:
    metrics["pg_token_fraction"] = jnp.sum(pg_weight) / jnp.maximum(jnp.sum(mask), 1.0)
  return loss, metrics
