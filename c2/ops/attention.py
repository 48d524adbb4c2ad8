"""Attention core: softmax(q k^T * scale + mask) v with causal masking inside packed segments.

Glossary: B batch, T query length, S key length, H heads, K query/key head dim, J value head dim.

Packed rows hold several documents; `segment_ids` (0 = padding) keep attention inside a document
and causality is by index within the row (documents are contiguous, so that equals causality by
position). Fully masked rows (padding) get a uniform distribution rather than NaNs: their outputs
are never used, but NaNs would poison gradients.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

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
