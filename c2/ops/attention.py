"""Attention core: softmax(q k^T * scale + mask) v with causal masking inside packed segments.

Glossary: B batch, T query length, S key length, H heads, K query/key head dim, J value head dim.

`attention` is the one entry point the model calls; `impl` picks an implementation of the same
function (they differ only in cost and float rounding):
  reference  `dot_product_attention` below, the specification: dense [B, H, T, S] float32
             scores. Fine for short rows; 64 heads x 32k^2 x 4 bytes = 256 GiB per sequence.
  blockwise  `c2.ops.blockwise_attention`: flash-style online softmax in plain jnp with a
             recomputing custom VJP; O(T x block) memory on any backend (the long-row CPU path).
  splash     `c2.ops.splash_attention`: jax's Pallas TPU splash kernel, per device in shard_map.
  auto       splash when the target is a TPU (the mesh's devices, so AOT compiles from a CPU host
             pick it too), else reference up to DENSE_MAX_LEN[platform] tokens and blockwise beyond.

Packed rows hold several documents; `segment_ids` (0 = padding) keep attention inside a document
and causality is by index within the row (documents are contiguous, so that equals causality by
position), or by explicit `positions` when a row's tokens are permuted (zig-zag context
parallelism: c2/data/zigzag.py, c2/ops/context_attention.py; splash always uses the index).
In `dot_product_attention` fully masked rows (padding) get a uniform distribution rather than
NaNs, which would poison gradients; `attention` then sets them to zero.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from c2.parallel.mesh import target_platform
from c2.ops.blockwise_attention import blockwise_attention
from c2.ops.splash_attention import splash_attention

IMPLS = ("auto", "reference", "blockwise", "splash")
# "auto" off TPU: dense [B, H, T, T] scores up to this many tokens, blockwise beyond. On CPU the
# blockwise path (skips masked blocks, never writes [T, T]) is faster from 512 tokens: the tiny
# model's forward + backward over 24,576 tokens per batch, blockwise vs dense, took 1.01x /
# 0.97x / 0.90x / 0.82x / 0.74x the time at 128 / 256 / 512 / 1,024 / 1,536 tokens per row in
# bfloat16 (0.83x / 0.77x at 512 / 1,536 in float32; measured 2026-12-05). Other backends (GPU)
# are unmeasured and keep dense scores up to 2,048.
DENSE_MAX_LEN = {"cpu": 256, "other": 2048}


def dense_max_len(platform: str) -> int:
  return DENSE_MAX_LEN.get(platform, DENSE_MAX_LEN["other"])

# Large finite negative: exp() underflows to 0 without producing inf - inf = NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                   q_index: Optional[jax.Array] = None, kv_index: Optional[jax.Array] = None,
                   causal: bool = True) -> jax.Array:
  """Boolean mask [B, 1, T, S]: same non-padding segment and (if causal) key index <= query index."""
  mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] != 0)
  if causal:
    t, s = q_segment_ids.shape[1], kv_segment_ids.shape[1]
    q_index = jnp.arange(t)[None, :] if q_index is None else q_index
    kv_index = jnp.arange(s)[None, :] if kv_index is None else kv_index
    mask &= q_index[:, :, None] >= kv_index[:, None, :]
  return mask[:, None, :, :]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                          q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                          q_index: Optional[jax.Array] = None,
                          kv_index: Optional[jax.Array] = None, causal: bool = True) -> jax.Array:
  """q [B, T, H, K], k [B, S, H, K], v [B, S, H, J] -> [B, T, H, J] (dtype of v).

  Scores and softmax run in float32 whatever the input dtype.
  """
  scores = jnp.einsum("BTHK,BSHK->BHTS", q, k, preferred_element_type=jnp.float32) * scale
  mask = attention_mask(q_segment_ids, kv_segment_ids, q_index, kv_index, causal)
  scores = jnp.where(mask, scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("BHTS,BSHJ->BTHJ", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.astype(v.dtype)


def resolve_impl(impl: str, seq_len: int) -> str:
  if impl not in IMPLS:
    raise ValueError(f"attention impl {impl!r}; choose one of {IMPLS}")
  if impl != "auto":
    return impl
  platform = target_platform()
  if platform == "tpu":
    return "splash"
  return "reference" if seq_len <= dense_max_len(platform) else "blockwise"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, segment_ids: jax.Array,
              impl: str = "auto", positions: Optional[jax.Array] = None,
              splash_fused_backward: bool = False, splash_query_chunks: int = 1) -> jax.Array:
  """Causal self-attention inside packed documents, by the implementation `impl` names
  (splash_fused_backward: c2.ops.splash_attention.block_sizes; splash_query_chunks:
  c2.ops.splash_attention.splash_attention).

  q [B, T, H, K], k [B, T, H, K], v [B, T, H, J], segment_ids [B, T] int (0 = padding),
  positions [B, T] int or None (None: causal by row index) -> [B, T, H, J] (dtype of v).
  Query rows with segment id 0 output zeros (and so pass no gradient): implementations fill
  padding rows differently, and zero is the one answer all can give exactly.
  """
  impl = resolve_impl(impl, q.shape[1])
  if impl == "reference":
    out = dot_product_attention(q, k, v, scale=scale, q_segment_ids=segment_ids,
                                kv_segment_ids=segment_ids, q_index=positions, kv_index=positions)
  elif impl == "blockwise":
    out = blockwise_attention(q, k, v, scale=scale, q_segment_ids=segment_ids,
                              kv_segment_ids=segment_ids, q_index=positions, kv_index=positions)
  else:
    if positions is not None:
      raise ValueError("the splash kernel is causal by row index; permuted rows (positions) need "
                       "the reference or blockwise impl, or c2.ops.context_attention")
    out = splash_attention(q, k, v, scale=scale, segment_ids=segment_ids,
                           fused_backward=splash_fused_backward,
                           query_chunks=splash_query_chunks)
  return jnp.where((segment_ids != 0)[:, :, None, None], out, 0).astype(v.dtype)
