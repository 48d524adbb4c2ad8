"""Quantise / dequantise for the low-precision matmul formats, with explicit scale layouts.

Every format quantises along one axis, `axis`, which callers set to the *contraction* axis of the
matmul that consumes the tensor (K for the forward, N for d_lhs, the token axis M for d_rhs). A
"row" is one slice along that axis; a "block" is `block` consecutive elements of a row.

| fmt    | values        | block scales (per `block` elements)   | row scales (per row)       |
|--------|---------------|----------------------------------------|----------------------------|
| bf16   | bfloat16      | -                                      | -                          |
| fp8    | float8_e4m3fn | -                                      | float32, amax/448          |
| mxfp8  | float8_e4m3fn | float8_e8m0fnu, 32, power of two, UP   | -                          |
| nvfp4  | float4_e2m1fn | float8_e4m3fn, 16, RNE                 | float32, amax/(6*448)      |

Shapes (x has shape S with S[axis] = n; nb = ceil(n / block)):
  values: S with S[axis] padded up to nb*block (padding is zeros);
  scales: S with S[axis] = nb;  row_scales: S with S[axis] = 1.
dequantize(quantize(x)) == values * scales (broadcast over each block) * row_scales.

Design rules (Composer 2 report section 6.1, research/algorithms.md section 9):
* Scales never reduce across rows, so a row's quantisation does not depend on the rest of the
  batch (batch invariance; no information flows between tokens).
* NVFP4's second-level scale is per row (Composer's variant), not per tensor, for the same reason.
* Divisions are IEEE divisions, never a reciprocal-multiply or an approximate reciprocal:
  Composer saw RL diverge with approximate division in the NVFP4 quantiser. XLA silently turns
  division by a broadcast or a constant into a multiply by the rounded reciprocal, so every
  division goes through `ieee_div`, which defeats that rewrite (tests check bit-exactness against
  numpy). MXFP8 divides by a power of two, which is exact either way.
* Casts saturate: values are clipped to the element format's max before the cast, so finite
  inputs never become inf/nan (e4m3fn has no inf, and an out-of-range cast gives nan).
* MXFP8's E8M0 scale is 2^ceil(log2(amax/448)) (rounded up, so no element saturates), computed
  exactly from the exponent bits rather than with log2.
Inputs must be finite; inf/nan in a row propagate into that row's scale.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest float4_e2m1fn
# E8M0 covers 2^-127..2^127; we stop at 2^-126 so the scale stays a normal float32/bfloat16
# (TPUs flush subnormals, and a flushed scale would divide by zero).
E8M0_MIN_EXP, E8M0_MAX_EXP = -126, 127
TINY = 2.0**-126  # smallest normal float32


@dataclasses.dataclass(frozen=True)
class Format:
  """A quantisation format: element dtype plus its scale layout."""
  name: str
  values_dtype: jnp.dtype
  block: int | None  # block length along the axis, None when there are no block scales
  scale_dtype: jnp.dtype | None  # block-scale dtype
  row_scale: bool  # one float32 scale per row (fp8's only scale, nvfp4's second level)

  @property
  def elem_max(self) -> float:
    return {"bf16": float("inf"), "fp8": E4M3_MAX, "mxfp8": E4M3_MAX, "nvfp4": E2M1_MAX}[self.name]


FORMATS = {
    "bf16": Format("bf16", jnp.dtype(jnp.bfloat16), None, None, False),
    "fp8": Format("fp8", jnp.dtype(jnp.float8_e4m3fn), None, None, True),
    "mxfp8": Format("mxfp8", jnp.dtype(jnp.float8_e4m3fn), 32, jnp.dtype(jnp.float8_e8m0fnu),
                    False),
    "nvfp4": Format("nvfp4", jnp.dtype(jnp.float4_e2m1fn), 16, jnp.dtype(jnp.float8_e4m3fn), True),
}


def get_format(fmt: str | Format) -> Format:
  if isinstance(fmt, Format):
    return fmt
  if fmt not in FORMATS:
    raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(FORMATS)}")
  return FORMATS[fmt]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "scales", "row_scales"],
    meta_fields=["fmt", "axis", "length"],
)
@dataclasses.dataclass(frozen=True)
class QTensor:
  """A quantised tensor. `scales`/`row_scales` are None where the format has none.

  values: S (axis padded to a block multiple); scales: S with axis -> n_blocks;
  row_scales: float32, S with axis -> 1. `axis` is non-negative; `length` is the unpadded size.
  """
  values: jax.Array
  scales: jax.Array | None
  row_scales: jax.Array | None
  fmt: str
  axis: int
  length: int

  @property
  def format(self) -> Format:
    return FORMATS[self.fmt]

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the tensor that was quantised."""
    s = list(self.values.shape)
    s[self.axis] = self.length
    return tuple(s)


def ieee_div(a: jax.Array, b) -> jax.Array:
  """a / b correctly rounded, for b broadcastable to a (a per-row or per-block scale).

  XLA's algebraic simplifier rewrites `x / broadcast(y)` and `x / constant` into
  `x * broadcast(1/y)`, which is off by an ulp for some x (0.1875 / 448, say), differs between
  shapes (a row of one is not broadcast, so a row quantised alone would differ from the same row
  in a batch), and is the reciprocal-multiply the Composer report warns about. Adding `a * 0`
  makes the divisor an ordinary elementwise value of a's shape, so the rewrite no longer matches;
  it stays in the same fusion, so nothing is materialised. (a * 0 is not folded for floats; for
  finite a it is +-0, and b + -0 == b for the nonzero scales used here.)
  """
  b = jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape)
  return a / (b + a * 0)


def _amax(x: jax.Array, axis) -> jax.Array:
  return jnp.max(jnp.abs(x), axis=axis, keepdims=True)


def _safe_scale(amax: jax.Array, elem_max: float) -> jax.Array:
  """amax / elem_max, at least the smallest normal float32, and 1 for an all-zero row/block.

  The floor keeps the scale from flushing to zero (TPUs and XLA:CPU flush subnormals), which
  would divide by zero; a row that small quantises to (near) zero values instead.
  """
  scale = jnp.maximum(ieee_div(amax, elem_max), jnp.float32(TINY))
  return jnp.where(amax > 0, scale, jnp.float32(1.0))


def e8m0_scale_exponent(amax: jax.Array) -> jax.Array:
  """Smallest k with amax <= 448 * 2^k, clamped to [-126, 127]; 0 for amax == 0. int32.

  amax = f * 2^e with f in [0.5, 1) and 448 = 0.875 * 2^9, so k = e - 9 when f <= 0.875 and
  e - 8 otherwise. This is exact, unlike ceil(log2(amax / 448)) in floating point.
  """
  f, e = jnp.frexp(amax)
  k = e - 9 + (f > 0.875).astype(jnp.int32)
  k = jnp.where(amax > 0, k, 0)
  return jnp.clip(k, E8M0_MIN_EXP, E8M0_MAX_EXP)


def _pinned(x: jax.Array) -> jax.Array:
  """Fix x as computed: XLA may not merge it into a later division (it rewrites (a / b) / c into
  a / (b * c)) nor move ops across it. Used on small per-row/per-block arrays, and on the input
  (free when it already sits in memory), so the result depends only on x's values, never on how
  x was produced."""
  return jax.lax.optimization_barrier(x)


def _split_axis(x: jax.Array, axis: int, block: int) -> jax.Array:
  """S -> S[:axis] + (nb, block) + S[axis+1:], zero-padding the axis to nb*block.

  The axis is split in place (no transpose), so XLA fuses the whole quantiser into a few
  passes over x whatever the axis (a transposed copy of an expert weight would cost GBs)."""
  pad = (-x.shape[axis]) % block
  if pad:
    x = jnp.pad(x, [(0, pad if d == axis else 0) for d in range(x.ndim)])
  return x.reshape(*x.shape[:axis], x.shape[axis] // block, block, *x.shape[axis + 1:])


def _quantize_split(xb: jax.Array, fmt: Format, axis: int):
  """Quantise xb = _split_axis(x) (blocks on `axis`, elements on axis + 1), in x's dtype.

  Returns (values like xb, scales [.., nb, 1, ..] or None, row scales [.., 1, 1, ..] or None).
  Per format, amax over the row or block and every division an IEEE division:
    fp8:   r = amax_row / 448;  v = e4m3(x / r)
    mxfp8: X = 2^k (e8m0_scale_exponent);  v = e4m3(x / X)
    nvfp4: r = amax_row / 2688;  S = e4m3((amax_block / r) / 6);  v = e2m1(x / (S * r))
  each cast round-to-nearest-even after clipping to the element max (saturation).
  """
  row_axes, block_axis = (axis, axis + 1), axis + 1
  # |x| and max are exact in any float dtype, so amaxes read x as it is; only the final division
  # converts to float32, inside its own fusion (a shared float32 copy of x would be materialised).
  amax = lambda axes: _amax(xb, axes).astype(jnp.float32)
  x32 = xb.astype(jnp.float32)
  if fmt.name == "fp8":
    row = _pinned(_safe_scale(amax(row_axes), E4M3_MAX))
    v = jnp.clip(ieee_div(x32, row), -E4M3_MAX, E4M3_MAX)
    return v.astype(fmt.values_dtype), None, row
  if fmt.name == "mxfp8":
    k = e8m0_scale_exponent(amax(block_axis))
    scale = _pinned(jnp.ldexp(jnp.ones(k.shape, jnp.float32), k))  # exact power of two
    v = jnp.clip(ieee_div(x32, scale), -E4M3_MAX, E4M3_MAX)
    return v.astype(fmt.values_dtype), scale.astype(fmt.scale_dtype), None
  if fmt.name == "nvfp4":
    block_scale, row, divisor = _nvfp4_scales(xb, axis)
    v = jnp.clip(ieee_div(x32, divisor), -E2M1_MAX, E2M1_MAX)
    return v.astype(fmt.values_dtype), block_scale, row
  raise AssertionError(fmt)


def _nvfp4_scales(xb: jax.Array, axis: int):
  """NVFP4 scales of a split view xb [.., nb, 16, ..] (blocks on `axis`): (block scales E4M3
  [.., nb, 1, ..], row scales f32 [.., 1, 1, ..], divisor S * r f32 [.., nb, 1, ..]).

  The divisor is inf where the E4M3 block scale underflows to zero (a block below 2^-10 of its
  row's max / 448): dividing by inf quantises the block to (signed) zero instead of nan."""
  amax = lambda axes: _amax(xb, axes).astype(jnp.float32)  # exact in any float dtype
  row = _pinned(_safe_scale(amax((axis, axis + 1)), E2M1_MAX * E4M3_MAX))
  block_amax = _pinned(ieee_div(amax(axis + 1), row))  # <= 6*448
  block_scale = jnp.clip(ieee_div(block_amax, E2M1_MAX), 0.0, E4M3_MAX)
  block_scale = block_scale.astype(FORMATS["nvfp4"].scale_dtype)  # round-to-nearest-even
  divisor = _pinned(block_scale.astype(jnp.float32) * row)
  return block_scale, row, jnp.where(divisor > 0, divisor, jnp.inf)


def quantize(x: jax.Array, fmt: str | Format, axis: int = -1) -> QTensor:
  """Quantise `x` along `axis` (the contraction axis of the consuming matmul). See module doc."""
  f = get_format(fmt)
  axis = axis % x.ndim
  if f.name == "bf16":
    return QTensor(x.astype(jnp.bfloat16), None, None, f.name, axis, x.shape[axis])
  block = f.block or max(x.shape[axis], 1)  # per-row formats: one block spanning the row
  # Pin the split view: otherwise XLA hoists the float32 convert above the reshape and, on TPU,
  # materialises a relaid-out float32 copy of x (5.6 GB for one Kimi expert-weight tensor).
  xb = _pinned(_split_axis(x, axis, block))  # [.., nb, B, ..]
  values, scales, rows = _quantize_split(xb, f, axis)
  padded = list(x.shape)
  padded[axis] = xb.shape[axis] * xb.shape[axis + 1]
  squeeze = lambda a: None if a is None else jnp.squeeze(a, axis + 1)
  if rows is not None:
    rows = rows.reshape(rows.shape[:axis] + (1,) + rows.shape[axis + 2:])  # [.., 1, ..]
  return QTensor(values.reshape(padded), squeeze(scales), rows, f.name, axis, x.shape[axis])


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
  """values * block scales * row scales, in float32 arithmetic, cropped to the original shape."""
  f, axis = q.format, q.axis
  v = q.values.astype(jnp.float32)
  if q.scales is not None:
    vb = _split_axis(v, axis, f.block)  # [.., nb, B, ..]
    v = (vb * jnp.expand_dims(q.scales.astype(jnp.float32), axis + 1)).reshape(v.shape)
  if q.row_scales is not None:
    v = v * q.row_scales
  return jax.lax.slice_in_dim(v, 0, q.length, axis=axis).astype(dtype)


def fake_quant(x: jax.Array, fmt: str | Format, axis: int = -1) -> jax.Array:
  """dequantize(quantize(x)) in x's dtype, with a straight-through gradient.

  This is the "quantise before dispatch" helper for MoE tokens: quantising rows to MXFP8 before
  the all-to-all loses nothing extra when the experts consume MXFP8 anyway (Composer 2 6.1). To
  also save the transport bytes, send `quantize(x, "mxfp8")` (a pytree) through the collective
  and call `dequantize` on arrival; per-row/per-block scales make the two routes identical.
  """
  return _fake_quant(x, get_format(fmt).name, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_quant(x, fmt, axis):
  return dequantize(quantize(x, fmt, axis), x.dtype)


def _fake_quant_fwd(x, fmt, axis):
  return _fake_quant(x, fmt, axis), None


def _fake_quant_bwd(fmt, axis, _, g):
  return (g,)


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)
