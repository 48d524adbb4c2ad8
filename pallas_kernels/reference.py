"""Plain-jnp references for the grouped matmuls. These are the specification the kernels match.

Each reference quantises its inputs exactly as the kernels do (same `quant.quantize`, along the
contraction axis), dequantises to float32, and multiplies in float32 at HIGHEST precision. The
kernels differ from them only by float32 summation order and by applying per-row scales after the
K-sum instead of before (both exact algebraically).

Glossary: M rows (tokens x top-k, contiguous by group), K contraction, N output, G groups.
Rows are assigned to groups in order: group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])).
Rows past sum(group_sizes) belong to no group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import quant

HIGHEST = jax.lax.Precision.HIGHEST


def group_one_hot(group_sizes: jax.Array, m: int) -> jax.Array:
  """[M, G] float32: 1 where row m belongs to group g; all-zero rows past sum(group_sizes)."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  starts = ends - group_sizes
  rows = jnp.arange(m, dtype=jnp.int32)[:, None]  # [M, 1]
  return ((rows >= starts[None, :]) & (rows < ends[None, :])).astype(jnp.float32)


def ragged_matmul_f32(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """out[m] = lhs[m] @ rhs[group(m)], zero for rows in no group. [M,K] x [G,K,N] -> [M,N] f32."""
  one_hot = group_one_hot(group_sizes, lhs.shape[0])  # [M, G]
  per_group = jnp.einsum("MK,GKN->GMN", lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                         precision=HIGHEST)
  return jnp.einsum("MG,GMN->MN", one_hot, per_group, precision=HIGHEST)


def ragged_transposed_matmul_f32(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array):
  """out[g] = sum over rows m of group g of lhs[m]^T grad[m]. [M,K] x [M,N] -> [G,K,N] f32."""
  one_hot = group_one_hot(group_sizes, lhs.shape[0])  # [M, G]
  masked = jnp.einsum("MG,MK->GMK", one_hot, lhs.astype(jnp.float32))
  return jnp.einsum("GMK,MN->GKN", masked, grad.astype(jnp.float32), precision=HIGHEST)


def fake_quant_f32(x: jax.Array, fmt: str, axis: int) -> jax.Array:
  return quant.dequantize(quant.quantize(x, fmt, axis=axis), jnp.float32)


def gmm(lhs, rhs, group_sizes, fmt: str = "bf16") -> jax.Array:
  """lhs [M,K], rhs [G,K,N] -> [M,N] float32; both quantised along K."""
  return ragged_matmul_f32(fake_quant_f32(lhs, fmt, 1), fake_quant_f32(rhs, fmt, 1), group_sizes)


def tgmm(lhs, grad, group_sizes, fmt: str = "bf16") -> jax.Array:
  """lhs [M,K], grad [M,N] -> [G,K,N] float32; both quantised along the token axis M.

  Empty groups get zeros. Quantisation blocks along M run across group boundaries (a block of
  32 tokens may hold two experts' rows); every group still sees the same dequantised rows.
  """
  return ragged_transposed_matmul_f32(
      fake_quant_f32(lhs, fmt, 0), fake_quant_f32(grad, fmt, 0), group_sizes)


def gmm_vjp(lhs, rhs, group_sizes, grad, bwd_fmt: str = "bf16"):
  """(d_lhs [M,K], d_rhs [G,K,N]) float32 for out = gmm(lhs, rhs), straight through quantisers.

  d_lhs = gmm(grad, rhs^T) contracts over N, so grad and rhs are quantised along N;
  d_rhs = tgmm(lhs, grad) contracts over M, so lhs and grad are quantised along M.
  """
  d_lhs = gmm(grad, jnp.swapaxes(rhs, 1, 2), group_sizes, bwd_fmt)  # [G,N,K] contracts N
  d_rhs = tgmm(lhs, grad, group_sizes, bwd_fmt)
  return d_lhs, d_rhs
