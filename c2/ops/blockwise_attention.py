"""Blockwise (flash-style) attention in plain jnp: O(T x block) memory, any backend.

Glossary: B batch, T query length, S key length, H heads, K query/key head dim, J value head dim,
Q query block, C key/value block, N number of blocks.

The same function as `c2.ops.attention.dot_product_attention` (causal inside packed segments,
float32 scores and softmax statistics), except that query rows with segment id 0 (padding)
output zeros and pass no gradient; the dispatcher applies that rule to every impl. Causality
compares `q_index >= kv_index`: by default the row index (arange), or explicit per-token arrays
such as positions, which stay correct when a row's tokens are permuted (zig-zag context
parallelism, c2/data/zigzag.py): positions restart per document and increase inside one.

Forward: for each query block, a scan over key blocks keeps the running max `m`, the running sum
`l` and the unnormalised output (the online softmax); it saves only the output and the
log-sum-exp per row. Backward (custom VJP): for each key block, a scan over query blocks
recomputes the probabilities from the saved log-sum-exp and accumulates dK, dV in the carry and
dQ in an [N, B, Q, H, K] float32 buffer. Peak temporaries are a few [B, H, Q, C] float32 tiles.

A (query block, key block) pair whose mask is empty - above the causal diagonal, between two
documents, or all padding - is skipped with `lax.cond`, so packed rows and causality cost
nothing on the host (on CPU the untaken branch is not executed).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # as in c2.ops.attention
_F32 = jnp.float32


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= n (block and lane padding)."""
  return -(-n // multiple) * multiple


def _blocks(x: jax.Array, size: int) -> jax.Array:
  """[B, T, ...] -> [N, B, size, ...] with N = T / size (T already padded)."""
  b, t = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, t // size, size, *x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
  """[N, B, size, ...] -> [B, N * size, ...]."""
  n, b, size = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(b, n * size, *x.shape[3:])


def tied_to(anchor: jax.Array, *mask_inputs):
  """(anchor, *mask_inputs) through an optimization barrier, so that the mask inputs (segment
  ids, positions) depend on `anchor`, an array that differs per layer (the forward's q).
  Under a scan over layers the mask inputs are the same in every layer, and JAX's scan partial
  evaluation (taking the gradient) hoists whatever of the forward depends only on loop
  invariants out of the layer loop: every tile's mask, computed for all tiles at once and
  stacked as [query blocks, key blocks, B, H, Q, C], the whole [T, T] score matrix this module
  exists to avoid (measured on the latent context-parallel path of the tiny model's 128k step:
  63 GiB of temporaries). The backward rule is traced only when transposed, and nothing was
  hoisted from it (checked with and without remat). The barrier computes nothing; on CPU this
  gradient under a 2-layer scan at T = 4096 took 652-671 ms with it, 945-998 ms without."""
  return jax.lax.optimization_barrier((anchor, *mask_inputs))


def block_mask(q_seg, kv_seg, q_idx, kv_idx, causal: bool) -> jax.Array:
  """q_seg, q_idx [B, Q], kv_seg, kv_idx [B, C] -> [B, 1, Q, C]: same non-padding segment and
  (if causal) q_idx >= kv_idx."""
  mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)
  if causal:
    mask &= q_idx[:, :, None] >= kv_idx[:, None, :]
  return mask[:, None]


def scores(q_, k_, mask, scale):
  """q_ [B, Q, H, K], k_ [B, C, H, K] -> masked float32 scores [B, H, Q, C]."""
  s = jnp.einsum("BQHK,BCHK->BHQC", q_, k_, preferred_element_type=_F32) * scale
  return jnp.where(mask, s, _MASK_VALUE)


def online_softmax_step(state, q_, k_, v_, mask, scale):
  """One key block folded into a query block's running softmax: state (m [B, H, Q] running max,
  l [B, H, Q] running sum, acc [B, H, Q, J] unnormalised output), all float32. Shared by the
  context-parallel latent path (c2/ops/context_attention.py)."""
  m, l, acc = state
  s = scores(q_, k_, mask, scale)  # [B, H, Q, C]
  m_new = jnp.maximum(m, s.max(-1))
  p = jnp.exp(s - m_new[..., None])
  alpha = jnp.exp(m - m_new)
  pv = jnp.einsum("BHQC,BCHJ->BHQJ", p.astype(v_.dtype), v_, preferred_element_type=_F32)
  return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv


def tile_grads(q_, k_, v_, do_, lse_, delta_, mask, scale):
  """One (query block, key block) tile of the flash backward from the saved log-sum-exp and
  delta = <dO, O>: -> float32 (dq [B, Q, H, K], dk [B, C, H, K], dv [B, C, H, J]); zeros without
  computing anything when the tile's mask is empty. Shared by the context-parallel latent path."""

  def grads(_):
    p = jnp.exp(scores(q_, k_, mask, scale) - lse_[..., None])  # [B, H, Q, C]
    dv = jnp.einsum("BHQC,BQHJ->BCHJ", p.astype(do_.dtype), do_, preferred_element_type=_F32)
    dp = jnp.einsum("BQHJ,BCHJ->BHQC", do_, v_, preferred_element_type=_F32)
    ds = p * (dp - delta_[..., None])
    dq = jnp.einsum("BHQC,BCHK->BQHK", ds.astype(k_.dtype), k_, preferred_element_type=_F32)
    dk = jnp.einsum("BHQC,BQHK->BCHK", ds.astype(q_.dtype), q_, preferred_element_type=_F32)
    return dq * scale, dk * scale, dv

  zeros = lambda _: (jnp.zeros(q_.shape, _F32), jnp.zeros(k_.shape, _F32),
                     jnp.zeros(v_.shape, _F32))
  return jax.lax.cond(jnp.any(mask), grads, zeros, None)


def _forward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, scale, causal, block_q, block_kv):
  """Padded inputs -> (out [B, T, H, J] dtype of v, lse [B, H, T] float32)."""
  q, q_seg, kv_seg, q_idx, kv_idx = tied_to(q, q_seg, kv_seg, q_idx, kv_idx)
  b, _, h, _ = q.shape
  j = v.shape[-1]
  ks, vs, kv_segs = _blocks(k, block_kv), _blocks(v, block_kv), _blocks(kv_seg, block_kv)
  kv_idxs = _blocks(kv_idx, block_kv)

  def q_block(_, xs):
    q_, q_seg_, q_idx_ = xs

    def kv_block(carry, ys):
      k_, v_, kv_seg_, kv_idx_ = ys
      mask = block_mask(q_seg_, kv_seg_, q_idx_, kv_idx_, causal)

      update = lambda state: online_softmax_step(state, q_, k_, v_, mask, scale)
      return jax.lax.cond(jnp.any(mask), update, lambda c: c, carry), None

    init = (jnp.full((b, h, block_q), _MASK_VALUE, _F32), jnp.zeros((b, h, block_q), _F32),
            jnp.zeros((b, h, block_q, j), _F32))
    (m, l, acc), _ = jax.lax.scan(kv_block, init, (ks, vs, kv_segs, kv_idxs))
    # l == 0 only where every key block was skipped: rows of an all-padding query block.
    empty = l == 0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))  # exp(s - inf) = 0
    return None, (jnp.einsum("BHQJ->BQHJ", out).astype(v.dtype), lse)

  qs, q_segs, q_idxs = _blocks(q, block_q), _blocks(q_seg, block_q), _blocks(q_idx, block_q)
  _, (outs, lses) = jax.lax.scan(q_block, None, (qs, q_segs, q_idxs))
  out = _unblocks(outs)  # [B, T, H, J]
  lse = jnp.moveaxis(lses, 0, 2).reshape(b, h, -1)  # [N, B, H, Q] -> [B, H, T]
  return jnp.where((q_seg != 0)[:, :, None, None], out, 0).astype(v.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_seg, kv_seg, q_idx, kv_idx, scale, causal, block_q, block_kv):
  return _forward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, scale, causal, block_q, block_kv)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, q_idx, kv_idx, scale, causal, block_q, block_kv):
  out, lse = _forward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, scale, causal, block_q, block_kv)
  return out, (q, k, v, q_seg, kv_seg, q_idx, kv_idx, out, lse)


def _flash_bwd(scale, causal, block_q, block_kv, residuals, d_out):
  q, k, v, q_seg, kv_seg, q_idx, kv_idx, out, lse = residuals
  b, t, h, kd = q.shape
  d_out = jnp.where((q_seg != 0)[:, :, None, None], d_out, 0).astype(v.dtype)  # padding rows
  # delta_i = sum_j p_ij dp_ij = <dO_i, O_i>: the softmax-backward correction per row.
  delta = jnp.einsum("BTHJ,BTHJ->BHT", d_out.astype(_F32), out.astype(_F32))
  qs, dos, q_segs = _blocks(q, block_q), _blocks(d_out, block_q), _blocks(q_seg, block_q)
  q_idxs = _blocks(q_idx, block_q)
  row_blocks = lambda x: jnp.moveaxis(x.reshape(b, h, -1, block_q), 2, 0)  # [B,H,T]->[N,B,H,Q]
  lses, deltas = row_blocks(lse), row_blocks(delta)
  num_q = qs.shape[0]

  def kv_block(dq_acc, xs):
    k_, v_, kv_seg_, kv_idx_ = xs

    def q_block(carry, ys):
      q_, do_, lse_, delta_, q_seg_, q_idx_ = ys
      mask = block_mask(q_seg_, kv_seg_, q_idx_, kv_idx_, causal)
      dq, dk, dv = tile_grads(q_, k_, v_, do_, lse_, delta_, mask, scale)
      return (carry[0] + dk, carry[1] + dv), dq

    init = (jnp.zeros(k_.shape, _F32), jnp.zeros(v_.shape, _F32))
    (dk, dv), dqs = jax.lax.scan(q_block, init, (qs, dos, lses, deltas, q_segs, q_idxs))
    return dq_acc + dqs, (dk, dv)

  ks, vs, kv_segs = _blocks(k, block_kv), _blocks(v, block_kv), _blocks(kv_seg, block_kv)
  dq_acc = jnp.zeros((num_q, b, block_q, h, kd), _F32)
  dq_acc, (dks, dvs) = jax.lax.scan(kv_block, dq_acc, (ks, vs, kv_segs, _blocks(kv_idx, block_kv)))
  return (_unblocks(dq_acc).astype(q.dtype), _unblocks(dks).astype(k.dtype),
          _unblocks(dvs).astype(v.dtype), None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                        q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                        q_index: Optional[jax.Array] = None, kv_index: Optional[jax.Array] = None,
                        causal: bool = True, block_q: int = 512, block_kv: int = 512) -> jax.Array:
  """q [B, T, H, K], k [B, S, H, K], v [B, S, H, J] -> [B, T, H, J] (dtype of v).

  segment_ids [B, T] / [B, S] int (0 = padding). q_index [B, T] / kv_index [B, S] int: what
  causality compares (default the row index; positions for permuted rows). Any T and S: both are
  padded up to a multiple of their (clipped) block with padding ids and sliced back. Blocks trade
  host speed (bigger: fewer scan steps) against temporary memory (B * H * block_q * block_kv * 4
  bytes per tile).
  """
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  block_q, block_kv = min(block_q, round_up(t, 8)), min(block_kv, round_up(s, 8))
  pad_t, pad_s = round_up(t, block_q) - t, round_up(s, block_kv) - s
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2))
  index = lambda x, n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)) if x is None else x
  q_index, kv_index = index(q_index, t), index(kv_index, s)
  out = _flash(pad(q, pad_t), pad(k, pad_s), pad(v, pad_s), pad(q_segment_ids, pad_t),
               pad(kv_segment_ids, pad_s), pad(q_index.astype(jnp.int32), pad_t),
               pad(kv_index.astype(jnp.int32), pad_s), float(scale), bool(causal), block_q,
               block_kv)
  return out[:, :t]
