"""Multi-head Latent Attention (MLA) with decoupled RoPE, as in DeepSeek-V3 / Kimi K2.

Glossary: B batch, T length, D model width, H heads, Q q_lora_rank, L kv_lora_rank,
N qk_nope_head_dim, R qk_rope_head_dim, K = N + R (query/key head dim), J v_head_dim.

  c_q   = RMSNorm(x @ W_qa)                      [B, T, Q]   (q_a_proj, q_a_layernorm)
  q     = c_q @ W_qb  -> [q_nope | q_rope]        [B, T, H, N + R]
  [c_kv | k_rope] = x @ W_kva                     [B, T, L + R] (kv_a_proj_with_mqa)
  c_kv  = RMSNorm(c_kv)                           (the rope part is not normed)
  [k_nope | v] = c_kv @ W_kvb                     [B, T, H, N + J]
  k     = [k_nope | RoPE(k_rope) broadcast to every head]
  out   = softmax(q k^T * scale) v @ W_o          [B, T, D]
The training path expands keys/values per head (cheaper for long prefill than the absorbed form).
When the mesh splits the row over context shards (c2.ops.context_attention), `context_parallel`
picks how: "latent_all_gather" gathers [c_kv | k_rope] (issued before the Q projection, so the
two can overlap) and up-projects key blocks inside the attention loop; "ulysses" swaps sequence
shards for head shards around the attention (on TPU: splash's implicit all-to-alls).
`sequence_layout` "zigzag" marks permuted rows (c2/data/zigzag.py): attention masks by position.
With a `cache` (decoding, c2/infer) the layer instead attends over the latent cache in the
weight-absorbed form (c2/model/latent_cache.py) and returns its new cache entries.
"""
from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2.model.config import YarnScaling
from c2.model.latent_cache import LayerCacheView, absorbed_attention, write_entries
from c2.model.layers import RMSNorm, default_init, logical_param
from c2.model.rope import apply_rotary, rotary_angles
from c2.ops import context_attention as cp_lib
from c2.ops.attention import attention, resolve_impl
from c2.parallel.sharding import constrain


class MLAttention(nn.Module):
  num_heads: int
  q_lora_rank: Optional[int]
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  rope_theta: float
  rope_scaling: Optional[YarnScaling]
  softmax_scale: float
  # q_a_layernorm / kv_a_layernorm: the reference modeling code (DeepSeek-V3 inference, the
  # modeling_deepseek.py shipped with Kimi, transformers' DeepseekV3Attention) builds them with
  # the RMSNorm default eps 1e-6, not config.rms_norm_eps (1e-5 in Kimi-K2.5).
  latent_norm_eps: float = 1e-6
  attention_impl: str = "auto"  # see c2.ops.attention.attention
  splash_fused_backward: bool = False  # see c2.ops.splash_attention.block_sizes
  splash_query_chunks: int = 1  # see c2.ops.splash_attention.splash_attention
  context_parallel: str = "ulysses"  # or "latent_all_gather" (c2.ops.context_attention)
  sequence_layout: str = "natural"  # or "zigzag" (c2.data.zigzag)
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  def _weight(self, name, shape, axes, contracted: int = 1):
    """A kernel whose first `contracted` dims are summed over in its einsum (the fan-in)."""
    dims = tuple(range(len(shape)))
    init = default_init(in_axis=dims[:contracted], out_axis=dims[contracted:])
    return logical_param(self, name, shape, axes, init, self.param_dtype).astype(self.dtype)

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array,
               cache: Optional[LayerCacheView] = None):
    """x [B, T, D], segment_ids [B, T] (0 = padding), positions [B, T] -> [B, T, D].

    With a cache: -> ([B, T, D], {"kv_entries": [B, T, L + R] = [c_kv | rotated k_rope]}), or
    {"kv_layer": the view's cache with them written} when the view is write-through.
    """
    d = x.shape[-1]
    h, n, r, j, l = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim,
                     self.v_head_dim, self.kv_lora_rank)
    norm = lambda name: RMSNorm(self.latent_norm_eps, self.dtype, self.param_dtype, name=name)
    x = x.astype(self.dtype)

    # Every weight is created first, in the order that fixes their init RNG streams.
    if self.q_lora_rank is None:
      w_q = self._weight("q", (d, h, n + r), ("embed", "heads", "head_dim"))
    else:
      w_qa = self._weight("q_a", (d, self.q_lora_rank), ("embed", "q_lora"))
      w_qb = self._weight("q_b", (self.q_lora_rank, h, n + r), ("q_lora", "heads", "head_dim"))
    w_kva = self._weight("kv_a", (d, l + r), ("embed", "kv_lora"))
    kv_b = self._weight("kv_b", (l, h, n + j), ("kv_lora", "heads", "head_dim"))
    w_out = self._weight("out", (h, j, d), ("heads", "head_dim", "embed"), contracted=2)
    cos, sin = rotary_angles(positions, r, self.rope_theta, self.rope_scaling)  # [B, T, R/2]

    # The latents first: under latent context parallelism their all-gather needs nothing else,
    # so it can overlap the Q projection.
    kv_a = jnp.einsum("BTD,DL->BTL", x, w_kva)
    c_kv, k_rope = kv_a[..., :l], kv_a[..., l:]  # [B, T, L], [B, T, R]
    c_kv = norm("kv_a_norm")(c_kv)
    k_rope = apply_rotary(k_rope, cos, sin)  # [B, T, R], one rotary key shared by all heads
    t = x.shape[1]
    shards = cp_lib.context_shards(t) if cache is None else 1
    latent_cp = shards > 1 and self.context_parallel == "latent_all_gather"

    if self.q_lora_rank is None:
      q = jnp.einsum("BTD,DHK->BTHK", x, w_q)
    else:
      c_q = norm("q_a_norm")(jnp.einsum("BTD,DQ->BTQ", x, w_qa))
      q = jnp.einsum("BTQ,QHK->BTHK", c_q, w_qb)
    q = constrain(q, ("batch", "length", "act_heads", None))
    q_nope, q_rope = q[..., :n], q[..., n:]
    q_rope = apply_rotary(q_rope, cos, sin)  # [B, T, H, R]

    if cache is not None:
      entries = jnp.concatenate([c_kv, k_rope], axis=-1)  # [B, T, L + R]
      stored = {"kv_entries": entries}
      if cache.write_through:
        kv = write_entries(cache.kv[None], None, cache.lengths, entries[None],
                           segment_ids != 0)[0]
        cache, stored = cache.replace(kv=kv), {"kv_layer": kv}
      out = absorbed_attention(q_nope, q_rope, c_kv, k_rope, kv_b, cache,
                               scale=self.softmax_scale, new_valid=segment_ids != 0)
      b, t, h, j = out.shape
      # One [B*T, H*J] x [H*J, D] product: the two-axis contraction as an einsum measured ~3x
      # slower on XLA:CPU at decode shapes.
      y = jnp.dot(out.reshape(b, t, h * j), w_out.reshape(h * j, -1))  # [B, T, D]
      return constrain(y, ("batch", "length", "act_embed")), stored

    q = jnp.concatenate([q_nope, q_rope], axis=-1)  # [B, T, H, K]
    if latent_cp:
      latents = jnp.concatenate([c_kv, k_rope], axis=-1)  # [B, T, L + R]
      out = cp_lib.latent_attention(q, latents, kv_b, segment_ids=segment_ids,
                                    positions=positions, scale=self.softmax_scale, nope_dim=n,
                                    layout=self.sequence_layout)  # [B, T, H, J]
    else:
      kv = jnp.einsum("BTL,LHK->BTHK", c_kv, kv_b)
      kv = constrain(kv, ("batch", "length", "act_heads", None))
      k_nope, v = kv[..., :n], kv[..., n:]
      k_rope_heads = jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:3] + (r,))
      k = jnp.concatenate([k_nope, k_rope_heads], axis=-1)  # [B, T, H, K]
      permuted = self.sequence_layout == "zigzag"
      if shards > 1 and resolve_impl(self.attention_impl, t) != "splash":
        out = cp_lib.ulysses_attention(q, k, v, segment_ids=segment_ids, positions=positions,
                                       scale=self.softmax_scale, impl=self.attention_impl)
      else:  # one shard, or splash's implicit Ulysses (causal by index: natural rows only)
        out = attention(q, k, v, scale=self.softmax_scale, segment_ids=segment_ids,
                        impl=self.attention_impl, positions=positions if permuted else None,
                        splash_fused_backward=self.splash_fused_backward,
                        splash_query_chunks=self.splash_query_chunks)
    out = constrain(out, ("batch", "length", "act_heads", None))
    y = jnp.einsum("BTHJ,HJD->BTD", out, w_out)
    return constrain(y, ("batch", "length", "act_embed"))
