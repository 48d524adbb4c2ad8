"""Sigmoid top-k routing with an aux-loss-free correction bias (DeepSeek-V3 `noaux_tc`).

Glossary: N tokens, D model width, E routed experts, K experts per token, G expert groups.

  s      = sigmoid(x @ W_router)                     [N, E]   affinities, float32
  choice = s + b                                     bias b shifts *selection* only
  (n_group > 1: keep the topk_group groups whose top-2 `choice` sum is largest)
  idx    = top_k(choice)                             [N, K]
  w      = s[idx] / sum(s[idx]) * routed_scaling     combine weights from unbiased s
The bias never reaches the combine weights and gets no gradient: it is moved by the load-balance
rule outside the optimizer (`c2.losses.moe_balance.aux_free_bias_update`, applied by `c2.model.update_router_biases`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp


NOT_RECORDED = -1  # a forced-route row of this value lets the token route itself


@dataclasses.dataclass(frozen=True)
class Routes:
  expert_ids: jax.Array  # [N, K] int32
  weights: jax.Array  # [N, K] float32, combine weights
  scores: jax.Array  # [N, E] float32, sigmoid affinities (unbiased)


def group_limited_mask(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
  """[N, E] bool: experts inside the topk_group best groups (group score = sum of its top-2)."""
  n, e = choice.shape
  grouped = choice.reshape(n, n_group, e // n_group)  # [N, G, E/G]
  group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
  _, best_groups = jax.lax.top_k(group_scores, topk_group)  # [N, topk_group]
  keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], best_groups].set(True)
  return jnp.repeat(keep, e // n_group, axis=1)


def route(x: jax.Array, kernel: jax.Array, bias: jax.Array, *, top_k: int, n_group: int,
          topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
          forced_expert_ids: Optional[jax.Array] = None) -> Routes:
  """x [N, D], kernel [D, E], bias [E]. `forced_expert_ids` [N, K] replays recorded routes; a
  token whose forced row is negative (NOT_RECORDED) routes itself (e.g. the last sampled token,
  which the sampler never fed to the model)."""
  logits = jnp.einsum("ND,DE->NE", x.astype(jnp.float32), kernel.astype(jnp.float32))
  scores = jax.nn.sigmoid(logits)
  choice = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
  if n_group > 1:
    choice = jnp.where(group_limited_mask(choice, n_group, topk_group), choice, -jnp.inf)
  _, expert_ids = jax.lax.top_k(jax.lax.stop_gradient(choice), top_k)
  if forced_expert_ids is not None:
    forced = forced_expert_ids.astype(jnp.int32)
    expert_ids = jnp.where(forced[:, :1] >= 0, forced, expert_ids)
  expert_ids = expert_ids.astype(jnp.int32)
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [N, K]
  if norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  return Routes(expert_ids, weights * routed_scaling_factor, scores)
