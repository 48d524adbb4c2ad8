"""Sigmoid top-k routing with an aux-loss-free correction bias (DeepSeek-V3 `noaux_tc`).

Glossary: N tokens, D model width, E routed experts, K experts per token, G expert groups.

  s      = sigmoid(x @ W_router)                     [N, E]   affinities, float32
  choice = s + b                                     bias b shifts *selection* only
  (n_group > 1: keep the topk_group groups whose top-2 `choice` sum is largest)
  idx    = top_k(choice)                             [N, K]
  w      = s[idx] / sum(s[idx]) * routed_scaling     combine weights from unbiased s
The bias never reaches the combine weights and gets no gradient: it is moved by the load-balance
rule outside the optimizer (`c2.losses.moe_balance.aux_free_bias_update`, applied by `c2.model.update_router_biases`).

Router replay (RL): `forced_expert_ids` [N, K] replaces idx with the sampler's recorded choice,
while w still comes from the trainer's own s (so the router keeps learning). A recorded expert
the trainer's router finds implausible falls back to the router's own choice (Composer 2 report
4.6: this cuts the p99 train/inference mismatch); `replay_fallback` picks the rule, see
`replay_threshold`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp


NOT_RECORDED = -1  # a forced-route row of this value lets the token route itself

# `replay_fallback` values: "rank" (default: plausible = among the router's own top 2K),
# "rank:M" (own top K + M), a float margin (own K-th best score minus margin), "off".
ReplayFallback = Union[str, float, None]
DEFAULT_REPLAY_FALLBACK = "rank"


@dataclasses.dataclass(frozen=True)
class Routes:
  expert_ids: jax.Array  # [N, K] int32
  weights: jax.Array  # [N, K] float32, combine weights
  scores: jax.Array  # [N, E] float32, sigmoid affinities (unbiased)
  overridden: jax.Array  # [N, K] bool, replayed entries replaced by the router's own choice


def group_limited_mask(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
  """[N, E] bool: experts inside the topk_group best groups (group score = sum of its top-2)."""
  n, e = choice.shape
  grouped = choice.reshape(n, n_group, e // n_group)  # [N, G, E/G]
  group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
  _, best_groups = jax.lax.top_k(group_scores, topk_group)  # [N, topk_group]
  keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], best_groups].set(True)
  return jnp.repeat(keep, e // n_group, axis=1)


def replay_threshold(eligible: jax.Array, top_k: int, rule: ReplayFallback) -> Optional[jax.Array]:
  """[N] float32 plausibility threshold from the router's own selection scores, or None (off).

  eligible [N, E]: selection scores s + b, -inf outside the allowed groups (what top-k ranks).
  A replayed expert is implausible when its selection score s_e + b_e is *below* the threshold:
    "rank"   -> the router's own (2K)-th best score: plausible = among its own top 2K candidates
    "rank:M" -> its own (K + M)-th best score (M >= 0; capped at E)
    margin   -> its own K-th best score minus `margin` (a float >= 0, in score units)
    "off" / None -> never implausible.
  Every rule sits at or below the K-th best score, so an expert the same router picked is never
  overridden: replaying a route the same weights chose is exact.
  """
  e = eligible.shape[-1]
  if rule is None or rule == "off":
    return None
  if isinstance(rule, str):
    if rule == "rank":
      slack = top_k
    elif rule.startswith("rank:") and rule[5:].isdigit():
      slack = int(rule[5:])
    else:
      raise ValueError(f"replay_fallback={rule!r}: expected 'rank', 'rank:M', 'off' or a float "
                       "margin >= 0")
    return jax.lax.top_k(eligible, min(top_k + slack, e))[0][:, -1]
  if isinstance(rule, bool) or not isinstance(rule, (int, float)) or rule < 0:
    raise ValueError(f"replay_fallback={rule!r}: a margin must be a float >= 0")
  return jax.lax.top_k(eligible, top_k)[0][:, -1] - float(rule)


def _fill_from_own(replayed: jax.Array, keep: jax.Array, own: jax.Array) -> jax.Array:
  """replayed, own [N, K] ids, keep [N, K] bool -> [N, K] ids: kept replayed ids stay in their
  slot; the r-th dropped slot (in slot order) gets the router's r-th best own id that is not
  already kept. Own top-K always holds enough: with K - d ids kept, at least d of its K are new."""
  already = jnp.any((own[:, None, :] == replayed[:, :, None]) & keep[:, :, None], axis=1)  # [N, K]
  fresh_rank = jnp.cumsum(~already, axis=-1) - 1  # [N, K] over own slots
  drop_rank = jnp.cumsum(~keep, axis=-1) - 1  # [N, K] over replayed slots
  # pick[n, i, j]: own slot j fills replayed slot i (I: replayed slot, J: own slot).
  pick = (~already[:, None, :]) & (fresh_rank[:, None, :] == drop_rank[:, :, None])  # [N, I, J]
  fill = jnp.sum(jnp.where(pick, own[:, None, :], 0), axis=-1)  # [N, I]
  return jnp.where(keep, replayed, fill)


def route(x: jax.Array, kernel: jax.Array, bias: jax.Array, *, top_k: int, n_group: int,
          topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
          forced_expert_ids: Optional[jax.Array] = None,
          replay_fallback: ReplayFallback = "off") -> Routes:
  """x [N, D], kernel [D, E], bias [E]. `forced_expert_ids` [N, K] replays recorded routes; a
  token whose forced row is negative (NOT_RECORDED) routes itself (e.g. the last sampled token,
  which the sampler never fed to the model). Replayed experts below `replay_threshold` (rule
  `replay_fallback`) are replaced by the router's own best experts not already in the row;
  `Routes.overridden` marks those entries. This bare function replays verbatim unless told a
  rule; the model's modules pass theirs (default DEFAULT_REPLAY_FALLBACK, on)."""
  logits = jnp.einsum("ND,DE->NE", x.astype(jnp.float32), kernel.astype(jnp.float32))
  scores = jax.nn.sigmoid(logits)
  selection = jax.lax.stop_gradient(scores + bias.astype(jnp.float32))  # [N, E]
  eligible = selection
  if n_group > 1:
    eligible = jnp.where(group_limited_mask(selection, n_group, topk_group), selection, -jnp.inf)
  _, expert_ids = jax.lax.top_k(eligible, top_k)
  overridden = jnp.zeros(expert_ids.shape, bool)
  if forced_expert_ids is not None:
    forced = forced_expert_ids.astype(jnp.int32)
    recorded = forced[:, :1] >= 0  # [N, 1]
    threshold = replay_threshold(eligible, top_k, replay_fallback)
    if threshold is not None:
      # Judged by its own score, not the group mask: a replayed expert from a group the trainer's
      # numerics happened not to pick is still plausible when it scores well.
      forced_score = jnp.take_along_axis(selection, jnp.maximum(forced, 0), axis=-1)  # [N, K]
      overridden = recorded & (forced_score < threshold[:, None])
      forced = _fill_from_own(forced, ~overridden, expert_ids)
    expert_ids = jnp.where(recorded, forced, expert_ids)
  expert_ids = expert_ids.astype(jnp.int32)
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [N, K]
  if norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  return Routes(expert_ids, weights * routed_scaling_factor, scores, overridden)
