"""gmm / tgmm Pallas kernels (interpret mode on CPU) against the float32 references.

Tolerances. The kernels quantise with the same `quant.quantize` as the references, along the same
axes, so both multiply bit-identical low-precision values and scales (zero padding changes no
amax). What remains is float32 rounding: the K-sum order (tiles, MXU) and row scales applied to
the sum instead of to each element. Both are bounded by a few float32 ulps of sum_k |a_k b_k|,
for every format alike, so each test checks |kernel - reference| <= RTOL * (|A| @ |B|) elementwise
with A, B the dequantised operands and RTOL = 1e-5: float32 summation of K <= 300 terms errs by
~sqrt(K) * 2^-24 typically, K * 2^-24 = 1.8e-5 in the worst case; the largest ratio measured over
48 random draws (all format pairs, forward and both gradients) was 6.1e-7. Any wrong scale, block,
row or group is off by orders of magnitude more.
What each *format* costs against unquantised float32 is a separate, looser check
(test_format_error_vs_float32) with bounds derived from the element precision.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels import reference, tuning

M, K, N, G = 300, 200, 150, 5  # 3 x 2 x 2 tiles of 128 (nvfp4 packed: one K tile of 256)
RTOL = 1e-5
# Small tiles so the test shapes span several m/k/n tiles; same code path as the "cpu" target.
# Group boundaries fall inside row tiles, whose 4 slabs of 32 rows are then computed one by one.
SMALL = dataclasses.replace(tuning.GENERATIONS["cpu"], name="cpu-small",
                            gmm_tiles=((float("inf"), (128, 128, 128)),),
                            tgmm_tiles=((float("inf"), (128, 128, 128)),), mxu_side=32)
# Forward/backward format pairs: every format appears once forward and once backward.
COMBOS = [("bf16", "bf16"), ("fp8", "fp8"), ("mxfp8", "nvfp4"), ("nvfp4", "mxfp8")]


@functools.lru_cache(maxsize=None)
def _fwd_bwd(fmt, bwd_fmt, gen=SMALL):
  """jit: (out, d_lhs, d_rhs) of pk.gmm, compiled once per format pair and target."""
  def run(lhs, rhs, gs, grad):
    out, vjp = jax.vjp(lambda a, b: pk.gmm(a, b, gs, fmt=fmt, bwd_fmt=bwd_fmt, target=gen),
                       lhs, rhs)
    return (out, *vjp(grad))
  return jax.jit(run)


@st.composite
def group_sizes(draw, m=M, g=G):
  """Ragged sizes with sum <= m; empty groups (and all-empty) come up often."""
  cuts = sorted(draw(st.lists(st.integers(0, m), min_size=g, max_size=g)))
  sizes = np.diff(np.array([0] + cuts))
  empty = np.array(draw(st.lists(st.booleans(), min_size=g, max_size=g)))
  return np.where(empty & draw(st.booleans()), 0, sizes).astype(np.int32)


def _inputs(seed, m=M, k=K, n=N, g=G):
  """Gaussian operands with row magnitudes spread over 2^-4..2^4 (exercises per-row scales)."""
  rng = np.random.default_rng(seed)
  spread = lambda *s: np.exp2(rng.integers(-4, 5, s)).astype(np.float32)
  lhs = rng.standard_normal((m, k)).astype(np.float32) * spread(m, 1)
  rhs = rng.standard_normal((g, k, n)).astype(np.float32) * spread(g, 1, n)
  grad = rng.standard_normal((m, n)).astype(np.float32) * spread(m, 1)
  return lhs, rhs, grad


def _assert_close(got, want, scale, what):
  got, want, scale = (np.asarray(a, np.float64) for a in (got, want, scale))
  excess = np.abs(got - want) - RTOL * scale
  assert np.all(excess <= 1e-30), f"{what}: max excess {excess.max():.3g}"


@functools.lru_cache(maxsize=None)
def _expected(fmt, bwd_fmt):
  """jit: reference (out, d_lhs, d_rhs) and their error scales |A| @ |B| of the dequantised
  operands (compiled once per format pair; eager reference code would recompile every op)."""
  fq = reference.fake_quant_f32

  def run(lhs, rhs, gs, grad):
    out = reference.gmm(lhs, rhs, gs, fmt)
    out_scale = reference.ragged_matmul_f32(jnp.abs(fq(lhs, fmt, 1)), jnp.abs(fq(rhs, fmt, 1)), gs)
    d_lhs, d_rhs = reference.gmm_vjp(lhs, rhs, gs, grad, bwd_fmt)
    rhs_t = jnp.swapaxes(rhs, 1, 2)  # [G, N, K]: d_lhs contracts N
    dl_scale = reference.ragged_matmul_f32(jnp.abs(fq(grad, bwd_fmt, 1)),
                                           jnp.abs(fq(rhs_t, bwd_fmt, 1)), gs)
    dr_scale = reference.ragged_transposed_matmul_f32(jnp.abs(fq(lhs, bwd_fmt, 0)),
                                                      jnp.abs(fq(grad, bwd_fmt, 0)), gs)
    return (out, out_scale), (d_lhs, dl_scale), (d_rhs, dr_scale)
  return jax.jit(run)


def _check_against_reference(got, lhs, rhs, gs, grad, fmt, bwd_fmt):
  """got = (out, d_lhs, d_rhs) from the kernels; compare each with its reference."""
  for name, value, (want, scale) in zip(("out", "d_lhs", "d_rhs"), got,
                                        _expected(fmt, bwd_fmt)(lhs, rhs, gs, grad)):
    _assert_close(value, want, scale, f"{fmt}/{bwd_fmt} {name}")


@pytest.mark.parametrize("fmt,bwd_fmt", COMBOS)
@settings(max_examples=6, deadline=None)
@given(gs=group_sizes(), seed=st.integers(0, 2**31))
@example(gs=np.zeros(G, np.int32), seed=0)  # every group empty: all outputs zero
@example(gs=np.array([0, 128, 0, 172, 0], np.int32), seed=1)  # tile-aligned, sum == M
def test_forward_and_gradients_match_reference(fmt, bwd_fmt, gs, seed):
  lhs, rhs, grad = _inputs(seed)
  out, d_lhs, d_rhs = _fwd_bwd(fmt, bwd_fmt)(lhs, rhs, gs, grad)
  assert out.shape == (M, N) and d_lhs.shape == (M, K) and d_rhs.shape == (G, K, N)
  _check_against_reference((out, d_lhs, d_rhs), lhs, rhs, gs, grad, fmt, bwd_fmt)
  np.testing.assert_array_equal(out[gs.sum():], 0.0)  # rows in no group
  np.testing.assert_array_equal(d_lhs[gs.sum():], 0.0)
  np.testing.assert_array_equal(np.asarray(d_rhs)[gs == 0], 0.0)  # empty experts


@pytest.mark.parametrize("fmt,bwd_fmt", COMBOS)
def test_rows_do_not_depend_on_other_rows(fmt, bwd_fmt):
  """Per-token scaling: scaling other tokens by 1e3 leaves a token's output bit-identical."""
  lhs, rhs, grad = _inputs(7)
  gs = np.array([60, 0, 100, 90, 40], np.int32)
  out = np.asarray(_fwd_bwd(fmt, bwd_fmt)(lhs, rhs, gs, grad)[0])
  other = lhs.copy()
  other[1::2] *= 1e3  # every odd row, in every group and tile
  out2 = np.asarray(_fwd_bwd(fmt, bwd_fmt)(other, rhs, gs, grad)[0])
  np.testing.assert_array_equal(out2[0::2], out[0::2])


# Mean relative error against the *unquantised* float32 product, |err| / (|A|@|B|): per element
# the format's relative rounding u gives product error <= ~2u |a||b|, and random signs average
# it down. bf16 u = 2^-9; e4m3 u = 2^-4 (fp8/mxfp8); e2m1 u = 2^-2 (nvfp4). Bounds ~ u.
FORMAT_MEAN_REL = {"bf16": 2.0**-9, "fp8": 2.0**-5, "mxfp8": 2.0**-5, "nvfp4": 2.0**-3}


@pytest.mark.parametrize("fmt,bwd_fmt", COMBOS)
def test_format_error_vs_float32(fmt, bwd_fmt):
  lhs, rhs, grad = _inputs(3)
  gs = np.array([50, 70, 0, 100, 80], np.int32)
  out = _fwd_bwd(fmt, bwd_fmt)(lhs, rhs, gs, grad)[0]
  exact = reference.ragged_matmul_f32(lhs, rhs, gs)
  scale = reference.ragged_matmul_f32(jnp.abs(lhs), jnp.abs(rhs), gs)
  rows = slice(0, int(gs.sum()))
  rel = np.mean(np.abs(np.asarray(out - exact)[rows]) / np.asarray(scale)[rows])
  assert rel < FORMAT_MEAN_REL[fmt], rel


def test_bf16_vjp_is_the_true_gradient():
  """Straight-through backward == autodiff of the float32 ragged matmul, on bf16-exact inputs
  (the kernel rounds every operand to bf16, so only float32 summation order may differ)."""
  lhs, rhs, grad = (jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32) for a in _inputs(5))
  gs = np.array([70, 0, 90, 100, 0], np.int32)
  got = _fwd_bwd("bf16", "bf16")(lhs, rhs, gs, grad)

  @jax.jit
  def autodiff(a, b, g):
    want, vjp = jax.vjp(lambda x, y: reference.ragged_matmul_f32(x, y, gs), a, b)
    d_lhs, d_rhs = vjp(g)
    a, b, g = jnp.abs(a), jnp.abs(b), jnp.abs(g)  # error scales
    return ((want, reference.ragged_matmul_f32(a, b, gs)),
            (d_lhs, reference.ragged_matmul_f32(g, jnp.swapaxes(b, 1, 2), gs)),
            (d_rhs, reference.ragged_transposed_matmul_f32(a, g, gs)))

  for name, value, (want, scale) in zip(("out", "d_lhs", "d_rhs"), got,
                                        autodiff(lhs, rhs, grad)):
    _assert_close(value, want, scale, name)


PATHS = {  # the other MXU / storage paths, forced on the interpret target
    "fp8-dequant": ("fp8", dataclasses.replace(SMALL, native_mxu_dtypes=frozenset())),
    "nvfp4-f4-in-vmem": ("nvfp4", dataclasses.replace(SMALL, fp4_in_vmem=True)),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_alternative_kernel_paths(path):
  fmt, gen = PATHS[path]
  lhs, rhs, grad = _inputs(11)
  gs = np.array([0, 130, 20, 0, 100], np.int32)
  _check_against_reference(_fwd_bwd(fmt, fmt, gen)(lhs, rhs, gs, grad), lhs, rhs, gs, grad, fmt,
                           fmt)


@pytest.mark.parametrize("shape,fmt", [
    ((1, 1, 1, 1), "nvfp4"), ((37, 300, 5, 3), "mxfp8"),
    pytest.param((140, 64, 260, 2), "fp8", marks=pytest.mark.slow)])
def test_odd_shapes_default_target(shape, fmt):
  """Shapes far from tile multiples, through the public API with the default (cpu) target."""
  m, k, n, g = shape
  lhs, rhs, grad = _inputs(13, m, k, n, g)
  gs = np.full(g, m // g, np.int32)
  _check_against_reference(_fwd_bwd(fmt, fmt, None)(lhs, rhs, gs, grad), lhs, rhs, gs, grad, fmt,
                           fmt)


def test_dtypes_and_public_tgmm():
  lhs, rhs, grad = _inputs(17)
  gs = jnp.array([100, 0, 50, 50, 60], jnp.int32)
  lhs16, rhs16 = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)

  @jax.jit
  def run(a, b, g):
    out = pk.gmm(a, b, gs, fmt="mxfp8", target=SMALL)
    d_rhs = pk.tgmm(a, g, gs, fmt="mxfp8", preferred_element_type=jnp.float32, target=SMALL)
    l_m, g_m = (jnp.abs(reference.fake_quant_f32(x, "mxfp8", 0)) for x in (a, g))
    return (out, reference.gmm(a, b, gs, "mxfp8"), d_rhs, reference.tgmm(a, g, gs, "mxfp8"),
            reference.ragged_transposed_matmul_f32(l_m, g_m, gs))

  out, want, d_rhs, want_dr, dr_scale = run(lhs16, rhs16, grad)
  assert out.dtype == jnp.bfloat16  # lhs dtype by default; accumulation stays float32
  np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=2**-8, atol=1e-6)
  assert d_rhs.dtype == jnp.float32 and d_rhs.shape == (G, K, N)
  _assert_close(d_rhs, want_dr, dr_scale, "tgmm")


def test_rejects_bad_arguments():
  lhs, rhs = jnp.zeros((8, 4)), jnp.zeros((2, 4, 3))
  with pytest.raises(ValueError, match="unknown format"):
    pk.gmm(lhs, rhs, jnp.zeros(2, jnp.int32), fmt="int3")
  with pytest.raises(ValueError, match="groups"):
    pk.gmm(lhs, rhs, jnp.zeros(3, jnp.int32))
  with pytest.raises(ValueError, match="contraction"):
    pk.gmm(lhs, jnp.zeros((2, 5, 3)), jnp.zeros(2, jnp.int32))
