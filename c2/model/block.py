"""One decoder block (pre-norm): x + MLA(norm(x)), then + FFN(norm(x)) where FFN is dense or MoE.

Glossary: B batch, T length, D model width, K experts per token.
A block is the unit that `nn.scan` stacks, so its call signature is (carry, *broadcast, scanned)
-> (carry, per-layer outputs).
"""
from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2.model.config import ModelConfig
from c2.model import dispatch
from c2.model.attention import MLAttention
from c2.model.latent_cache import LayerCacheView, window_sizes, write_entries
from c2.model.layers import GatedFFN, RMSNorm
from c2.ops import splash_attention
from c2.model.moe import MoE
from c2.model.router import DEFAULT_REPLAY_FALLBACK, ReplayFallback


class DecoderBlock(nn.Module):
  """Builds its sublayers from the model config; the sublayers themselves take plain sizes."""

  cfg: ModelConfig
  use_moe: bool
  replay_fallback: ReplayFallback = DEFAULT_REPLAY_FALLBACK  # router replay rule (c2.model.router)

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array,
               forced_routes: Optional[jax.Array] = None,
               cache: Optional[LayerCacheView] = None) -> tuple[jax.Array, dict]:
    """x [B, T, D] -> (x [B, T, D], aux); aux is {} for dense blocks (see `MoE`). With a cache
    (decoding) aux also holds `kv_entries` [B, T, L + R], the new tokens' cache entries, or
    `kv_layer`, the view's cache with them written (a write-through view)."""
    cfg = self.cfg
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    attn_in = RMSNorm(cfg.rms_norm_eps, dtype, param_dtype, name="attn_norm")(x)
    attn_out = MLAttention(
        num_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
        softmax_scale=cfg.softmax_scale, attention_impl=cfg.attention_impl,
        splash_fused_backward=cfg.splash_fused_backward,
        splash_query_chunks=cfg.splash_query_chunks,
        context_parallel=cfg.context_parallel, sequence_layout=cfg.sequence_layout, dtype=dtype,
        param_dtype=param_dtype, name="attn")(attn_in, segment_ids, positions, cache)
    cache_aux = {}
    if cache is not None:
      attn_out, cache_aux = attn_out
    x = x + attn_out
    ffn_in = RMSNorm(cfg.rms_norm_eps, dtype, param_dtype, name="ffn_norm")(x)
    if not self.use_moe:
      return x + GatedFFN(cfg.dense_ffn_size, dtype, param_dtype, name="mlp")(ffn_in), cache_aux
    y, aux = MoE(
        num_experts=cfg.num_routed_experts, experts_per_token=cfg.experts_per_token,
        expert_ffn_size=cfg.moe_ffn_size, shared_ffn_size=cfg.shared_ffn_size,
        n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor, gmm_impl=cfg.gmm_impl,
        gmm_fmt=cfg.gmm_fmt, gmm_bwd_fmt=cfg.gmm_bwd_fmt, dispatch_fmt=cfg.dispatch_fmt,
        a2a_impl=cfg.a2a_impl, ep_capacity_factor=cfg.ep_capacity_factor,
        replay_fallback=self.replay_fallback, dtype=dtype, param_dtype=param_dtype,
        name="moe")(ffn_in, segment_ids, forced_routes)
    return x + y, {**aux, **cache_aux}


# Dot outputs with at least this many contracted elements are kept by `save_wide_dots`: each kept
# element spares 2 x contraction FLOPs of recompute for its bytes.
WIDE_CONTRACTION = 4096


def _wide_dots_saveable(prim, *avals, **params) -> bool:
  """A jax remat policy: save dot_general outputs whose contraction is >= WIDE_CONTRACTION.

  In a block: the projections out of the model width (q_a, kv_a, the router, the dense and
  shared FFN's gate/up, contraction D = 7168), the attention output projection (H x J = 8192)
  and the dense FFN's down projection; not the narrow up-projections q_b (Q = 1536), kv_b
  (L = 512) and the shared expert's down projection (2048), nor the routed experts (Pallas or
  ragged_dot, no dot_general)."""
  if prim is not jax.lax.dot_general_p:
    return False
  (lhs_contracting, _), _ = params["dimension_numbers"]
  return math.prod(avals[0].shape[d] for d in lhs_contracting) >= WIDE_CONTRACTION


def remat_policy(name: str):
  """full: recompute the whole block in the backward pass (least memory, ~1/3 more FLOPs).
  save_attention: recompute all but the attention kernel's outputs (its output and logsumexp, a
  few bytes per token and head), so the backward never reruns the forward attention kernel: at
  32k tokens that kernel is most of a layer's FLOPs.
  save_wide_dots: save_attention, and also keep the matmul outputs with a wide contraction
  (`_wide_dots_saveable`: ~14k values per token and layer for ~106M recomputed MACs spared);
  the routed experts, q_b and kv_b are still recomputed.
  save_dots: keep every matmul output, plus the Pallas kernels' outputs (expert matmuls, the
  attention kernel's) and the dispatched expert rows, by checkpoint name: a Pallas call is no
  dot to jax's policy, and without the names the backward would rerun the expert matmuls, the
  attention kernel and the all-to-all.
  offload_experts: save_attention, and also keep the routed experts' gate and up projections
  ([M, F] each, per dispatched row), in host memory: the backward reruns only their down
  projection. Full kimi-k2.5 at 32k on v5p (README), with splash's heads padded to 256 as
  before 2026-12-06: FLOP ratio 1.385 -> 1.295 (1.456 -> 1.354 before the grouped matmuls'
  boundary slabs), 63.4 GiB with layouts.full's query chunks
  (74.0 in one splash call), ~60 GB of host memory per device (with the down projection too,
  XLA asked 165 GB, over its 128 GB).
  save_experts: offload_experts with the gate and up outputs kept in HBM, for layouts with
  fewer tokens per device. Full kimi-k2.5, 512 rows of 32k at context 8 (fsdp 32; half of
  layouts.full's batch): 74.2 GiB (78%), FLOP ratio 1.211 (1.315 with splash at 128-lane heads);
  1,024 rows would need gradient accumulation, which the step does not have."""
  policies = jax.checkpoint_policies
  save_attention = policies.save_only_these_names(splash_attention.KERNEL_OUTPUTS)
  return {
      "full": policies.nothing_saveable,
      "save_attention": save_attention,
      "save_wide_dots": policies.save_from_both_policies(_wide_dots_saveable, save_attention),
      "offload_experts": policies.save_and_offload_only_these_names(
          names_which_can_be_saved=[splash_attention.KERNEL_OUTPUTS],
          names_which_can_be_offloaded=[dispatch.EXPERT_GATE_UP],
          offload_src="device", offload_dst="pinned_host"),
      "save_experts": policies.save_only_these_names(splash_attention.KERNEL_OUTPUTS,
                                                     dispatch.EXPERT_GATE_UP),
      "save_dots": policies.save_from_both_policies(
          policies.dots_with_no_batch_dims_saveable,
          policies.save_only_these_names(dispatch.DISPATCHED_ROWS, dispatch.EXPERT_GATE_UP,
                                         dispatch.EXPERT_DOWN, splash_attention.KERNEL_OUTPUTS)),
  }[name]


class BlockStack(nn.Module):
  """`num_layers` identical blocks under `nn.scan` (params stacked on a leading `layers` axis).

  Scanning keeps compile time flat in depth: the 61-layer model compiles one block body.
  """

  cfg: ModelConfig
  use_moe: bool
  num_layers: int
  replay_fallback: ReplayFallback = DEFAULT_REPLAY_FALLBACK

  @nn.compact
  def __call__(self, x, segment_ids, positions, forced_routes=None, cache=None):
    """forced_routes: None or [num_layers, B, T, K]. Returns (x, aux stacked over layers).

    cache (decoding): (stack [num_layers, slots, S, L + R], rows [B] slot ids or None for all
    slots, lengths [B]). Layers read their slice of the stack; the new entries of every layer
    come out of the scan and go into the stack in one scatter after it (in place on a donated
    cache: writing inside the scan made XLA copy the whole stack per layer). The updated stack
    is returned as aux["kv_cache"].
    """
    block = DecoderBlock
    if self.cfg.remat_policy != "none" and cache is None:
      block = nn.remat(block, policy=remat_policy(self.cfg.remat_policy), prevent_cse=False)
    scan = lambda body: nn.scan(
        body, variable_axes={"params": 0}, split_rngs={"params": True},
        in_axes=0, length=self.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"})
    if not self.cfg.scan_layers:
      return self._unrolled(block, x, segment_ids, positions, forced_routes, cache)
    module = block(self.cfg, self.use_moe, self.replay_fallback, name="block")

    if cache is None:
      def body(module, carry, layer_routes):
        return module(carry, segment_ids, positions, layer_routes)

      return scan(body)(module, x, forced_routes)

    stack, rows, lengths = cache

    def cached_body(module, x, scanned):
      layer_cache, layer_routes = scanned  # [slots, S, C], one layer's slice of the stack
      view = LayerCacheView(layer_cache if rows is None else layer_cache[rows], lengths,
                            windows=window_sizes(layer_cache.shape[-2], self.cfg.cache_windows))
      return module(x, segment_ids, positions, layer_routes, view)

    x, aux = scan(cached_body)(module, x, (stack, forced_routes))
    stack = write_entries(stack, rows, lengths, aux.pop("kv_entries"), segment_ids != 0)
    return x, {**aux, "kv_cache": stack}

  def _unrolled(self, block, x, segment_ids, positions, forced_routes, cache):
    """The same computation with one module per layer (`layer_{i}`, unstacked params): no
    per-layer slice of a stacked weight, which XLA:CPU copies on every call."""
    auxes = []
    for i in range(self.num_layers):
      view = None
      if cache is not None:  # a stack [Y, slots, S, C] or one array per layer (c2/infer/cache.py)
        stack, rows, lengths = cache
        own_array = isinstance(stack, (tuple, list)) and rows is None
        view = LayerCacheView(stack[i] if rows is None else stack[i][rows], lengths,
                              write_through=own_array,
                              windows=window_sizes(stack[i].shape[-2], self.cfg.cache_windows))
      layer_routes = None if forced_routes is None else forced_routes[i]
      x, aux = block(self.cfg, self.use_moe, self.replay_fallback, name=f"layer_{i}")(
          x, segment_ids, positions, layer_routes, view)
      auxes.append(aux)
    stored = None if cache is None else [
        aux.pop("kv_layer") if "kv_layer" in aux else aux.pop("kv_entries") for aux in auxes]
    aux = jax.tree.map(lambda *layers: jnp.stack(layers), *auxes)  # stacked as the scan's
    if cache is None:
      return x, aux
    valid = segment_ids != 0
    if own_array:  # each layer wrote its own array
      stack = tuple(stored)
    elif isinstance(stack, (tuple, list)):  # per-layer arrays, each written in place
      stack = tuple(write_entries(layer[None], rows, lengths, new[None], valid)[0]
                    for layer, new in zip(stack, stored))
    else:
      stack = write_entries(stack, rows, lengths, jnp.stack(stored), valid)
    return x, {**aux, "kv_cache": stack}
