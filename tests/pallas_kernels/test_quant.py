"""Property tests for pallas_kernels.quant: error bounds, exact grids, saturation, zeros,
batch invariance, and agreement with an independent numpy (IEEE float32) implementation."""
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import quant

FMTS = ["bf16", "fp8", "mxfp8", "nvfp4"]
ROWS, COLS = 6, 80  # 80 is not a multiple of 32 or 16: exercises the padded last block
EXAMPLES = settings(max_examples=30, deadline=None)
_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


@st.composite
def matrices(draw, rows=ROWS, cols=COLS):
  """Finite float32 rows whose magnitudes span ~2^-20..2^20 across rows and within blocks."""
  mags = st.one_of(st.just(0.0), st.floats(2.0**-10, 1.0, width=32))
  base = draw(hnp.arrays(np.float32, (rows, cols), elements=mags))
  base = base * draw(hnp.arrays(np.float32, (rows, cols), elements=st.sampled_from([-1.0, 1.0])))
  row_exp = draw(hnp.arrays(np.int32, (rows, 1), elements=st.integers(-20, 20)))
  col_exp = draw(hnp.arrays(np.int32, (1, cols), elements=st.integers(-6, 6)))
  return np.ldexp(base, row_exp + col_exp).astype(np.float32)


# Jitted once per (format, shape): eager op-by-op dispatch would recompile every op per shape.
_quantize = jax.jit(quant.quantize, static_argnames=("fmt", "axis"))
_dequantize = jax.jit(quant.dequantize)


def _roundtrip(x, fmt, axis=-1):
  q = _quantize(jnp.asarray(x), fmt, axis=axis)
  return q, np.asarray(_dequantize(q), np.float64)


def _blockwise(a, block, cols):
  """Repeat per-block values [R, nb] over their elements -> [R, cols]."""
  return np.repeat(np.asarray(a, np.float64), block, axis=-1)[:, :cols]


@pytest.mark.parametrize("fmt", FMTS)
@EXAMPLES
@given(x=matrices())
def test_roundtrip_error_bound(fmt, x):
  q, y = _roundtrip(x, fmt)
  ax = np.abs(x.astype(np.float64))
  err = np.abs(y - x)
  slop = 1e-6 * ax + 1e-30  # float32 rounding of the dequantised product
  if fmt == "bf16":  # RNE to 8 significant bits: half an ulp is 2^-8 relative
    bound = 2.0**-8 * ax
  elif fmt == "fp8":  # half an e4m3 ulp (2^-4 relative) or half the subnormal step 2^-9 * r
    r = np.asarray(q.row_scales, np.float64)
    bound = 2.0**-4 * ax + 2.0**-10 * r
    np.testing.assert_allclose(r[:, 0], ax.max(1) / 448 + (ax.max(1) == 0), rtol=1e-6)
  elif fmt == "mxfp8":  # same in units of the block's power-of-two scale X
    s = _blockwise(q.scales.astype(jnp.float32), 32, COLS)
    bound = 2.0**-4 * ax + 2.0**-10 * s
    amax_b = _blockwise(np.abs(np.pad(x, ((0, 0), (0, 16)))).reshape(ROWS, -1, 32).max(-1), 32,
                        COLS)
    assert np.all(amax_b <= 448 * s)  # rounded up: nothing saturates ...
    assert np.all((s <= 2 * amax_b / 448) | (amax_b == 0) | (s == 2.0**-126))  # ... by < 2x
  else:  # nvfp4: a quarter of |x| on the E2M1 grid, +quarter step near 0, +flushed tiny blocks
    r = np.asarray(q.row_scales, np.float64)
    s = _blockwise(q.scales.astype(jnp.float32), 16, COLS) * r
    bound = 0.25 * ax + 0.25 * s + 6 * 2.0**-10 * r
  assert np.all(err <= bound + slop), np.max(err - bound)


@pytest.mark.parametrize("fmt", FMTS)
@EXAMPLES
@given(data=st.data())
def test_values_on_the_grid_are_exact(fmt, data):
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
  e = data.draw(st.integers(-40, 40))
  if fmt == "bf16":
    x = rng.standard_normal((ROWS, COLS)).astype(ml_dtypes.bfloat16).astype(np.float32)
  elif fmt in ("fp8", "mxfp8"):
    bits = rng.integers(0, 256, (ROWS, COLS), dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # drop the nan codes
    v = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    v[:, 0] = 448.0  # fp8: row amax 448 * 2^e makes the row scale exactly 2^e
    if fmt == "mxfp8":  # mxfp8: any power of two per block keeps values on the grid
      v = v * np.repeat(np.ldexp(1.0, rng.integers(-5, 5, (ROWS, 3))), 32, 1)[:, :COLS]
    x = np.ldexp(v, e).astype(np.float32)
  else:  # nvfp4: E2M1 values, an E4M3 scale per block with block max 6, first block scale 448
    v = _E2M1[rng.integers(0, 16, (ROWS, COLS))]
    v[:, ::16] = 6.0  # every block's max is 6
    bits = rng.integers(8, 0x7F, (ROWS, 5), dtype=np.uint8)  # positive normal e4m3
    scale = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale[:, 0] = 448.0
    x = np.ldexp(v * np.repeat(scale, 16, 1)[:, :COLS], e).astype(np.float32)
  _, y = _roundtrip(x, fmt)
  np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("fmt", FMTS)
def test_saturates_instead_of_inf_or_nan(fmt):
  big = np.float32(3.0e38)
  x = np.array([[big, -big, 1.0, -1e-3] * 20, [1e30, 7.0, -6.5, 449.0] * 20], np.float32)
  q, y = _roundtrip(x, fmt)
  for a in (q.values, q.scales, q.row_scales):
    if a is not None:
      assert np.all(np.isfinite(np.asarray(a, np.float32)))
  assert np.all(np.isfinite(y))
  np.testing.assert_allclose(y[:, ::4], x[:, ::4].astype(np.float64), rtol=0.26)  # row maxima


@pytest.mark.parametrize("fmt", FMTS)
def test_zero_rows_and_zero_blocks(fmt):
  x = np.zeros((3, 96), np.float32)
  x[1, 40:50] = np.linspace(-3, 3, 10)  # row 1: blocks 0 and 2 (of 32 or 16) are all zero
  q, y = _roundtrip(x, fmt)
  np.testing.assert_array_equal(y[0], 0.0)
  np.testing.assert_array_equal(y[2], 0.0)
  np.testing.assert_array_equal(y[1, :32], 0.0)
  np.testing.assert_array_equal(y[1, 64:], 0.0)
  if q.row_scales is not None:  # zero rows get scale 1: nothing divides by zero later
    assert np.all(np.asarray(q.row_scales) > 0)
  if fmt == "mxfp8":  # E8M0 has no zero
    assert np.all(np.asarray(q.scales.astype(jnp.float32)) > 0)
  if fmt == "nvfp4":  # an all-zero block has block scale 0 (E4M3 has a zero) and values 0
    assert np.all(np.asarray(q.scales.astype(jnp.float32))[1, [0, 1, 4, 5]] == 0)


def _bits(q):
  """Bit patterns of every array (via float32, exact for all the element types)."""
  return [None if a is None else np.asarray(a.astype(jnp.float32)).view(np.uint32)
          for a in (q.values, q.scales, q.row_scales)]


@pytest.mark.parametrize("fmt", FMTS)
@settings(max_examples=15, deadline=None)
@given(x=matrices(), pos=st.integers(0, ROWS - 1), other=matrices())
def test_batch_invariance(fmt, x, pos, other):
  """A row quantises identically alone, in its batch, and inside an unrelated batch."""
  alone = _bits(_quantize(jnp.asarray(x[pos:pos + 1]), fmt))
  in_batch = _bits(_quantize(jnp.asarray(x), fmt))
  mixed = np.concatenate([other[:pos], x[pos:pos + 1], other[pos:] * 1e6], 0)
  in_other = _bits(_quantize(jnp.asarray(mixed), fmt))
  for a, b, c in zip(alone, in_batch, in_other):
    if a is not None:
      np.testing.assert_array_equal(a[0], b[pos])
      np.testing.assert_array_equal(a[0], c[pos])


def test_axis_and_shapes():
  """Scales have the documented shapes for a non-last axis (the rhs layout [G, K, N])."""
  x = jax.ShapeDtypeStruct((2, 70, 5), jnp.float32)
  q = jax.eval_shape(lambda a: quant.quantize(a, "nvfp4", axis=1), x)
  assert q.values.shape == (2, 80, 5) and q.scales.shape == (2, 5, 5)
  assert q.row_scales.shape == (2, 1, 5) and q.shape == (2, 70, 5)
  q = jax.eval_shape(lambda a: quant.quantize(a, "mxfp8", axis=1), x)
  assert q.values.shape == (2, 96, 5) and q.scales.shape == (2, 3, 5) and q.row_scales is None
  assert jax.eval_shape(quant.dequantize, q).shape == (2, 70, 5)
  leaves = jax.tree_util.tree_leaves(jax.eval_shape(lambda a: quant.quantize(a, "fp8", 0), x))
  assert len(leaves) == 2  # values + row scales; metadata is static


def _numpy_nvfp4(x):
  """Independent float32 (IEEE, numpy) NVFP4 quantiser for one [R, 16*nb] array."""
  f32 = np.float32
  amax = np.abs(x).max(1, keepdims=True)
  row = np.where(amax > 0, np.maximum(amax / f32(2688), f32(2.0**-126)), f32(1))[..., None]
  block_amax = np.abs(x.reshape(x.shape[0], -1, 16)).max(-1, keepdims=True) / row
  s = np.minimum(block_amax / f32(6), f32(448)).astype(ml_dtypes.float8_e4m3fn)
  d = s.astype(f32) * row
  with np.errstate(divide="ignore", invalid="ignore"):
    v = np.where(d > 0, x.reshape(d.shape[0], -1, 16) / np.where(d > 0, d, 1), 0)
  v = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn)
  return v.reshape(x.shape), s[..., 0], row[..., 0]


def _numpy_fp8(x):
  f32 = np.float32
  amax = np.abs(x).max(1, keepdims=True)
  row = np.where(amax > 0, np.maximum(amax / f32(448), f32(2.0**-126)), f32(1))
  return np.clip(x / row, -448, 448).astype(ml_dtypes.float8_e4m3fn), None, row


@pytest.mark.parametrize("fmt,numpy_quantize", [("nvfp4", _numpy_nvfp4), ("fp8", _numpy_fp8)])
@settings(max_examples=20, deadline=None)
@given(x=matrices(cols=64))
def test_matches_ieee_numpy(fmt, numpy_quantize, x):
  """Bit-exact with numpy's IEEE float32 division: no reciprocal-multiply crept in (XLA rewrites
  x / broadcast(s) and (a / b) / c unless quant.py prevents it)."""
  expected = numpy_quantize(x)
  q = _quantize(jnp.asarray(x), fmt)
  for got, want in zip((q.values, q.scales, q.row_scales), expected):
    if want is not None:
      np.testing.assert_array_equal(np.asarray(got).astype(np.float32), want.astype(np.float32))


def test_fake_quant_is_straight_through():
  x = jnp.linspace(-3.0, 3.0, 64).reshape(2, 32)
  y, grad = jax.jit(lambda a: jax.value_and_grad(
      lambda b: jnp.sum(quant.fake_quant(b, "mxfp8") * b))(a))(x)
  _, deq = _roundtrip(x, "mxfp8")
  np.testing.assert_allclose(y, np.sum(deq * np.asarray(x)), rtol=1e-6)
  np.testing.assert_allclose(grad, deq + np.asarray(x), rtol=1e-6)  # d/db: fq(b) + b * 1
  assert jax.eval_shape(lambda a: quant.fake_quant(a, "nvfp4"),
                        x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_e8m0_exponent_is_exact_round_up():
  amax = jnp.array([448.0, 448.00003, 896.0, 1.0, 0.0, 3e38, 1e-37])
  k = np.asarray(quant.e8m0_scale_exponent(amax))
  np.testing.assert_array_equal(k[:5], [0, 1, 1, -8, 0])
  assert k[5] == 120 and k[6] == -126  # 2^119 < 3e38/448 <= 2^120; 1e-37 clamps to 2^-126
