"""Mixture-of-experts FFN: sigmoid router, dropless routed experts, one shared expert.

Glossary: B batch, T length, D model width, E routed experts, F expert FFN width, K top-k.

  y = shared(x) + sum_k w_k * expert_{idx_k}(x)
On a mesh, the routed part runs inside `shard_map` (batch, length and expert axes manual): each
shard routes its own tokens and, with expert parallelism, exchanges them with an explicit
all-to-all (`c2.nn.dispatch`). Expert FFN columns sharded over `tensor` are summed with a psum.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from c2.model import dispatch
from c2.model.layers import GatedFFN, default_init, logical_param
from c2.losses.moe_balance import expert_counts, sequence_balance_loss
from c2.model.router import DEFAULT_REPLAY_FALLBACK, ReplayFallback, route
from c2.ops.gmm import grouped_matmul, resolve_impl
from c2.parallel.mesh import target_platform
from c2.parallel.sharding import constrain, logical_to_spec


class MoE(nn.Module):
  num_experts: int
  experts_per_token: int
  expert_ffn_size: int
  shared_ffn_size: int
  n_group: int
  topk_group: int
  norm_topk_prob: bool
  routed_scaling_factor: float
  gmm_impl: str = "auto"
  gmm_fmt: str = "bf16"
  gmm_bwd_fmt: Optional[str] = None
  dispatch_fmt: Optional[str] = None
  a2a_impl: str = "auto"
  ep_capacity_factor: Optional[float] = None
  replay_fallback: ReplayFallback = DEFAULT_REPLAY_FALLBACK  # see c2.model.router.replay_threshold
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array,
               forced_routes: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
    """x [B, T, D] -> (y [B, T, D], aux): load [E], balance_loss [], routes [B, T, K], dropped [],
    replay_override_rate [] (fraction of the replayed (token, slot) entries of real tokens that
    fell back to the router's own choice; 0 without forced_routes)."""
    b, t, d = x.shape
    e, f, k = self.num_experts, self.expert_ffn_size, self.experts_per_token
    router_kernel = logical_param(self, "router", (d, e), ("embed", None), default_init(),
                                  self.param_dtype)
    # Float32 always: its updates are +-gamma steps far below bf16 resolution near 1.
    bias = logical_param(self, "correction_bias", (e,), (None,), nn.initializers.zeros, jnp.float32)
    expert_init = default_init(batch_axis=(0,))  # E independent [in, out] matrices
    w_gate = logical_param(self, "gate", (e, d, f), ("experts", "embed", "expert_mlp"),
                           expert_init, self.param_dtype).astype(self.dtype)
    w_up = logical_param(self, "up", (e, d, f), ("experts", "embed", "expert_mlp"),
                         expert_init, self.param_dtype).astype(self.dtype)
    w_down = logical_param(self, "down", (e, f, d), ("experts", "expert_mlp", "embed"),
                           expert_init, self.param_dtype).astype(self.dtype)

    tokens = x.reshape(b * t, d)
    forced = None if forced_routes is None else forced_routes.reshape(b * t, k)
    routes = route(tokens, router_kernel, bias, top_k=k, n_group=self.n_group,
                   topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                   routed_scaling_factor=self.routed_scaling_factor, forced_expert_ids=forced,
                   replay_fallback=self.replay_fallback)
    expert_ids = routes.expert_ids.reshape(b, t, k)
    token_mask = segment_ids > 0
    # Padding (segment 0) gets no routed output on every path, and the dense path skips it: all
    # padding tokens are alike, so they pile onto the same experts and inflate the largest group.
    weights = routes.weights.reshape(b, t, k) * token_mask[..., None]

    routed, dropped = self._routed_experts(x.astype(self.dtype), expert_ids, weights, w_gate, w_up,
                                           w_down, token_mask)
    shared = GatedFFN(self.shared_ffn_size, self.dtype, self.param_dtype, name="shared")(x)
    y = constrain(routed.astype(self.dtype) + shared, ("batch", "length", "act_embed"))
    aux = {
        "load": expert_counts(routes.expert_ids, token_mask.reshape(-1), num_experts=e),
        "balance_loss": sequence_balance_loss(routes.scores.reshape(b, t, e), expert_ids,
                                              token_mask, num_experts=e, top_k=k),
        "routes": expert_ids,
        "dropped": dropped,  # token-choices lost to a bounded expert-parallel buffer
        "replay_override_rate": _override_rate(routes.overridden, forced, token_mask.reshape(-1)),
    }
    return y, aux

  def _gmm(self):
    return functools.partial(grouped_matmul, impl=self.gmm_impl, fmt=self.gmm_fmt,
                             bwd_fmt=self.gmm_bwd_fmt)

  def _transport(self):
    if self.dispatch_fmt is None:
      return None
    from pallas_kernels import quant  # pylint: disable=import-outside-toplevel
    # Quantise-dequantise with a straight-through gradient: the values that travel are exactly
    # what an MXFP8 all-to-all would deliver.
    return functools.partial(quant.fake_quant, fmt=self.dispatch_fmt)

  def _local_ffn(self, *args, token_mask=None):
    """Experts on this device: all-experts batched matmuls for `dense` (skipping tokens outside
    token_mask), else sort + gmm."""
    if resolve_impl(self.gmm_impl) == "dense":
      return dispatch.all_experts_ffn(*args, token_mask=token_mask)
    return dispatch.local_ffn(*args, self._gmm())

  def _routed_experts(self, x, expert_ids, weights, w_gate, w_up, w_down, token_mask):
    b, t, d = x.shape
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or math.prod(mesh.axis_sizes) == 1:
      y = self._local_ffn(x.reshape(b * t, d), expert_ids.reshape(b * t, -1),
                          weights.reshape(b * t, -1), w_gate, w_up, w_down,
                          token_mask=token_mask.reshape(b * t))
      return y.reshape(b, t, d), jnp.zeros((), jnp.int32)

    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    token_spec = logical_to_spec(("batch", "length", None), x.shape, sizes)
    route_spec = logical_to_spec(("batch", "length", None), expert_ids.shape, sizes)
    w_in_spec = logical_to_spec(("experts", None, "expert_mlp"), w_gate.shape, sizes)
    w_out_spec = logical_to_spec(("experts", "expert_mlp", None), w_down.shape, sizes)
    expert_axis, tensor_axis = w_in_spec[0], w_in_spec[2]
    num_shards = math.prod(sizes[a] for a in _as_tuple(expert_axis))
    a2a_impl = self.a2a_impl
    if a2a_impl == "auto":
      a2a_impl = "padded" if target_platform() == "cpu" else "ragged"
    gmm, transport = self._gmm(), self._transport()

    def body(x_, ids_, w_, gate_, up_, down_):
      b_, t_, _ = x_.shape
      args = (x_.reshape(b_ * t_, d), ids_.reshape(b_ * t_, -1), w_.reshape(b_ * t_, -1),
              gate_, up_, down_)
      if num_shards == 1:
        y_, dropped_ = self._local_ffn(*args), jnp.zeros((), jnp.int32)
      else:
        y_, dropped_ = dispatch.expert_parallel_ffn(
            *args, gmm, axis_name=expert_axis, num_shards=num_shards, a2a_impl=a2a_impl,
            transport_fn=transport, capacity_factor=self.ep_capacity_factor)
      if tensor_axis is not None:
        y_ = jax.lax.psum(y_, tensor_axis)  # expert FFN columns were split over `tensor`
      if token_axes:  # shards holding different tokens add their drops
        dropped_ = jax.lax.psum(dropped_, token_axes)
      return y_.reshape(b_, t_, d), dropped_

    token_axes = tuple(a for entry in token_spec for a in _as_tuple(entry))
    return jax.shard_map(body, in_specs=(token_spec, route_spec, route_spec, w_in_spec, w_in_spec,
                                         w_out_spec),
                         out_specs=(token_spec, P()), check_vma=False)(
                             x, expert_ids, weights, w_gate, w_up, w_down)


def _override_rate(overridden: jax.Array, forced: Optional[jax.Array],
                   token_mask: jax.Array) -> jax.Array:
  """overridden, forced [N, K], token_mask [N] -> float32 []: overridden / replayed entries."""
  if forced is None:
    return jnp.zeros((), jnp.float32)
  replayed = (forced[:, 0] >= 0) & token_mask  # [N]
  count = jnp.sum(overridden & replayed[:, None]).astype(jnp.float32)
  return count / jnp.maximum(jnp.sum(replayed).astype(jnp.float32) * overridden.shape[-1], 1.0)


def _as_tuple(axis) -> tuple:
  if axis is None:
    return ()
  return axis if isinstance(axis, tuple) else (axis,)
