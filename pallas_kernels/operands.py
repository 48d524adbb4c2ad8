"""The layout contract between the wrappers and the kernels for quantised matmul operands.

`quant.QTensor` is the public, natural layout; `lanes_operand` and `sublanes_operand` quantise
straight into the kernels' layout. The kernels want every block they load to be legal for
Mosaic: the last two block dims must be (multiple of 8 x 8-bit packing, multiple of 128) or the
full array dims. 8-bit scale blocks with 16 sublanes are rejected, so block scales are
regrouped by contraction tile to make their per-tile dims *full* dims:

  contraction on lanes   (gmm lhs [M,K]):     scales [M, K/B]   -> [K/tk, M, tk/B]
  contraction on sublanes (gmm rhs [G,K,N]):  scales [G, K/B, N] -> [G, K/tk, tk/B, N]
  contraction on sublanes (tgmm x [M,X]):     scales [M/B, X]   -> [M/tm, tm/B, X]

Row scales (float32) stay [rows, 1] / [1, cols] so they broadcast against the accumulator.

NVFP4 values on chips whose Mosaic cannot hold float4 in VMEM travel as uint8 holding two codes:
within each contraction tile of size t, byte j holds element j (low nibble) and element j + t/2
(high nibble). Decoding yields the tile's two halves, which are concatenated along the contraction
axis, so nothing is interleaved at lane granularity.

In-kernel decoding (`decode`) upcasts to float32, expands block scales over their blocks with a
0/1 matmul (each output is one scale times 1, exact; scales are E8M0/E4M3 and exact in bfloat16),
and multiplies. Products of an E4M3 or E2M1 value with its block scale have at most 6 significant
bits, so the result is exact in bfloat16: dequantising before a BF16 MXU matmul loses nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import quant


class KernelOperand(NamedTuple):
  """Kernel-layout arrays of one quantised operand; None where the format has none."""
  values: jax.Array
  scales: jax.Array | None
  row_scales: jax.Array | None


# ----------------------------------------------------------------------------- host side


def pack_fp4(values: jax.Array, axis: int, tile: int) -> jax.Array:
  """float4_e2m1fn -> uint8, two codes per byte: element j (low nibble) and j + tile/2 (high
  nibble) of each tile along `axis`. The axis is split in place ([.., T, 2, tile/2, ..]).

  XLA:TPU runs this as a second pass over one-byte codes (1.4 GB for a Kimi expert weight);
  neither a fused-slice nor a reduction form convinced it to pack inside the quantiser's fusion.
  """
  codes = jax.lax.bitcast_convert_type(values, jnp.uint4).astype(jnp.uint8)
  shape = codes.shape
  split = codes.reshape(*shape[:axis], shape[axis] // tile, 2, tile // 2, *shape[axis + 1:])
  low = jax.lax.index_in_dim(split, 0, axis + 1, keepdims=False)  # [.., T, tile/2, ..]
  high = jax.lax.index_in_dim(split, 1, axis + 1, keepdims=False)
  return (low | (high << 4)).reshape(*shape[:axis], shape[axis] // 2, *shape[axis + 1:])


def _quantize(x: jax.Array, fmt: quant.Format, axis: int, tile: int, packed: bool):
  q = quant.quantize(x, fmt, axis=axis)
  return (pack_fp4(q.values, axis, tile) if packed else q.values), q.scales, q.row_scales


def lanes_operand(x: jax.Array, fmt: quant.Format, tk: int, packed: bool) -> KernelOperand:
  """gmm lhs [M, K] quantised along K (lanes). scales -> [K/tk, M, tk/B]; rows [M, 1]."""
  values, scales, rows = _quantize(x, fmt, 1, tk, packed)
  if scales is not None:
    m, nb = scales.shape
    per_tile = tk // fmt.block
    scales = scales.reshape(m, nb // per_tile, per_tile).transpose(1, 0, 2)  # [Kt, M, tkb]
  return KernelOperand(values, scales, rows)


def sublanes_operand(x: jax.Array, fmt: quant.Format, tile: int, packed: bool, *,
                     rows_last: bool = False) -> KernelOperand:
  """[..., C, X] quantised along C (sublanes): gmm rhs [G,K,N] (C=K) and tgmm inputs [M,X].

  scales [..., C/B, X] -> [..., C/tile, tile/B, X]. Row scales are [..., 1, X]; with rows_last
  they become [X, 1] (tgmm's lhs, whose X is the *row* axis of the [K, N] output tile).
  """
  values, scales, rows = _quantize(x, fmt, x.ndim - 2, tile, packed)
  if scales is not None:
    *lead, nb, cols = scales.shape
    per_tile = tile // fmt.block
    scales = scales.reshape(*lead, nb // per_tile, per_tile, cols)
  if rows is not None and rows_last:
    rows = rows.reshape(-1, 1)  # [1, X] -> [X, 1]
  return KernelOperand(values, scales, rows)


# ----------------------------------------------------------------------------- kernel side


def mxu_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """[R,C] x [C,S] -> float32 [R,S] in one MXU pass of the operands' own dtype.

  Precision is pinned to DEFAULT so the kernels ignore jax_default_matmul_precision (Mosaic
  rejects "highest", i.e. fp32 contract precision, on bf16 operands). Every operand here is bf16
  or e4m3, whose products are exact in float32, so DEFAULT loses nothing.
  """
  return jnp.dot(a, b, precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32)


def _decode_e2m1(code: jax.Array) -> jax.Array:
  """4-bit E2M1 codes (int32, sign|exp(2)|mantissa) -> float32. Magnitudes 0, .5, 1, 1.5, 2,
  3, 4, 6: in units of 0.5 they are m (exp 0) or (2 + m) << (exp - 1)."""
  sign = (code >> 3) & 1
  exp = (code >> 1) & 3
  man = code & 1
  halves = jnp.where(exp == 0, man, (2 + man) << jnp.maximum(exp - 1, 0))
  mag = halves.astype(jnp.float32) * 0.5
  return jnp.where(sign == 1, -mag, mag)


def _unpack_fp4(packed: jax.Array, axis: int) -> jax.Array:
  codes = packed.astype(jnp.int32)
  low, high = _decode_e2m1(codes & 15), _decode_e2m1(codes >> 4)
  return jnp.concatenate([low, high], axis=axis)


def _expand_blocks(scales: jax.Array, axis: int, block: int, size: int) -> jax.Array:
  """Repeat each scale `block` times along `axis` (the contraction axis of the tile).

  axis 1: scales [R, nb] -> [R, size];  axis 0: scales [nb, C] -> [size, C]. Done as a matmul
  with a 0/1 matrix because lane-splitting reshapes are not expressible in Mosaic.
  """
  shift = block.bit_length() - 1  # block is a power of two
  nb = scales.shape[axis]
  s = scales.astype(jnp.float32).astype(jnp.bfloat16)
  if axis == 1:
    sel = (jax.lax.broadcasted_iota(jnp.int32, (nb, size), 1) >> shift) == \
        jax.lax.broadcasted_iota(jnp.int32, (nb, size), 0)
    return mxu_dot(s, sel.astype(jnp.bfloat16))
  sel = (jax.lax.broadcasted_iota(jnp.int32, (size, nb), 0) >> shift) == \
      jax.lax.broadcasted_iota(jnp.int32, (size, nb), 1)
  return mxu_dot(sel.astype(jnp.bfloat16), s)


def decode(values: jax.Array, scales: jax.Array | None, fmt: quant.Format, *, axis: int,
           packed: bool) -> jax.Array:
  """A loaded operand tile -> float32 values times block scales (row scales are left out).

  `axis` is the contraction axis of the tile (1: lanes, 0: sublanes); `scales` is the tile's
  block scales, [R, nb] for axis 1 or [nb, C] for axis 0.
  """
  x = _unpack_fp4(values, axis) if packed else values.astype(jnp.float32)
  if scales is not None:
    x = x * _expand_blocks(scales, axis, fmt.block, x.shape[axis])
  return x
