"""c2/perf/hlo_flops.py: matmul FLOPs of compiled TPU programs (libtpu, compile only), against closed forms
and against XLA's own cost analysis where XLA's is right (programs without loops)."""
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from c2.perf import hlo_flops
from c2.ops import splash_attention

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytestmark = pytest.mark.tpu_aot

M, K, N, G = 1024, 512, 256, 8


@pytest.fixture(scope="module")
def tpu_sharding():
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
  return NamedSharding(jax.sharding.Mesh([devices[0]], ("x",)), P())


def _compile(fn, *shapes, sharding):
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
  with jax.default_matmul_precision("default"):
    return jax.jit(fn).lower(*args).compile()


def test_loop_free_matmuls_match_xla_cost_analysis(tpu_sharding):
  """Dense and batched matmuls (no elementwise work): both counts are the closed form."""
  def fn(x, w, a, b):
    return x @ w, jnp.einsum("GMK,GKN->GMN", a, b)

  compiled = _compile(fn, ((M, K), jnp.bfloat16), ((K, N), jnp.bfloat16),
                      ((G, 128, K), jnp.bfloat16), ((G, K, N), jnp.bfloat16),
                      sharding=tpu_sharding)
  expected = 2 * M * K * N + 2 * G * 128 * K * N
  count = hlo_flops.count_flops(compiled.as_text())
  assert count.total == expected
  assert compiled.cost_analysis()["flops"] == expected
  assert count.unknown_trip_count_loops == [] and count.uncounted_kernels == []


def test_scanned_layers_count_every_iteration(tpu_sharding):
  """XLA's cost analysis counts a while body once; the layer stack runs under scan."""
  layers = 6

  def fn(x, ws):
    return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]

  compiled = _compile(fn, ((M, K), jnp.bfloat16), ((layers, K, K), jnp.bfloat16),
                      sharding=tpu_sharding)
  per_layer = 2 * M * K * K
  assert hlo_flops.count_flops(compiled.as_text()).total == layers * per_layer
  assert compiled.cost_analysis()["flops"] < 2 * per_layer  # the reason this module exists


def test_nested_loops_and_remat_multiply(tpu_sharding):
  """A rematerialised scan inside an outer loop: forward, recompute and two backward matmuls."""
  layers, outer = 3, 2

  def loss(x, ws):
    body = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
    return jnp.sum(jax.lax.scan(body, x, ws)[0].astype(jnp.float32))

  def fn(x, ws):
    def step(carry, _):
      return carry + jax.grad(loss, argnums=1)(x, ws), None
    return jax.lax.scan(step, jnp.zeros_like(ws), None, length=outer)[0]

  compiled = _compile(fn, ((M, K), jnp.bfloat16), ((layers, K, K), jnp.bfloat16),
                      sharding=tpu_sharding)
  count = hlo_flops.count_flops(compiled.as_text())
  # forward + recomputed forward (XLA may CSE it away) + d_input + d_weight per layer and step
  per_layer = 2 * M * K * K
  assert count.total in (outer * layers * 4 * per_layer, outer * layers * 3 * per_layer)
  assert count.unknown_trip_count_loops == []


def test_ragged_dot_weight_gradient_is_dense_over_groups(tpu_sharding):
  """XLA's TPU ragged_dot: forward is a Mosaic kernel with a cost estimate (M rows), but the
  weight gradient lowers to a dilated convolution that computes every row for every group."""
  def fn(lhs, rhs, sizes):
    return jax.grad(lambda l, r: jnp.sum(jax.lax.ragged_dot(l, r, sizes).astype(jnp.float32)),
                    argnums=(0, 1))(lhs, rhs)

  compiled = _compile(fn, ((M, K), jnp.bfloat16), ((G, K, N), jnp.bfloat16), ((G,), jnp.int32),
                      sharding=tpu_sharding)
  count = hlo_flops.count_flops(compiled.as_text())
  assert count.by_kind["xla dot/convolution"] == G * 2 * M * K * N
  assert sum(v for k, v in count.by_kind.items() if k.startswith("kernel")) == 2 * M * K * N
  # XLA's total adds a little elementwise work on top of the same matmuls
  assert count.total <= compiled.cost_analysis()["flops"] <= 1.01 * count.total


def test_pallas_kernels_count_their_cost_estimate(tpu_sharding):
  import pallas_kernels  # pylint: disable=import-outside-toplevel

  def fn(lhs, rhs, sizes):
    return pallas_kernels.gmm(lhs, rhs, sizes, fmt="bf16")

  with pallas_kernels.use_target("v5p"):
    compiled = _compile(fn, ((M, K), jnp.bfloat16), ((G, K, N), jnp.bfloat16),
                        ((G,), jnp.int32), sharding=tpu_sharding)
  count = hlo_flops.count_flops(compiled.as_text())
  v5p = pallas_kernels.tuning.get_generation("v5p")
  assert pallas_kernels.tuning.select_tiles("gmm", v5p, M, K, N, G, "bf16", 2)[0] > v5p.mxu_side
  # every row, plus one MXU slab per group boundary (a slab shared by two groups is computed
  # for each; the rest of a shared row tile is skipped)
  assert count.by_kind == {"kernel gmm_bf16": 2 * (M + (G - 1) * v5p.mxu_side) * K * N}


def test_unknown_trip_count_is_reported(tpu_sharding):
  def fn(x, w, n):
    return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ w, c[1] + 1), (x, 0))[0]

  compiled = _compile(fn, ((M, K), jnp.bfloat16), ((K, K), jnp.bfloat16), ((), jnp.int32),
                      sharding=tpu_sharding)
  count = hlo_flops.count_flops(compiled.as_text())
  assert len(count.unknown_trip_count_loops) == 1
  assert count.total == 2 * M * K * K  # counted once, and flagged


def test_conditional_counts_the_costlier_branch(tpu_sharding):
  def fn(x, w, pred):
    return jax.lax.cond(pred, lambda: (x @ w) @ w, lambda: x @ w)

  compiled = _compile(fn, ((M, K), jnp.bfloat16), ((K, K), jnp.bfloat16), ((), jnp.bool_),
                      sharding=tpu_sharding)
  assert hlo_flops.count_flops(compiled.as_text()).total == 2 * 2 * M * K * K


def test_multiline_instructions_parse():
  text = "\n".join([
      "HloModule m",
      "%body (p: f32[2,3]) -> f32[2,2] {",
      "  %p = f32[2,3]{1,0} parameter(0)",
      "  %t = f32[3,2]{1,0} transpose(%p), dimensions={1,0}, frontend_attributes={k={",
      '"a":"{\\"x\\": 1}"',
      "}}, metadata={op_name=\"t\"}",
      "  ROOT %d = f32[2,2]{1,0} dot(%p, %t), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
      "}",
      "ENTRY %main (a: f32[2,3]) -> f32[2,2] {",
      "  %a = f32[2,3]{1,0} parameter(0)",
      "  ROOT %c = f32[2,2]{1,0} call(%a), to_apply=%body",
      "}",
  ])
  count = hlo_flops.count_flops(text)
  assert count.total == 2 * 2 * 2 * 3


@pytest.mark.parametrize("seq_len,block,fraction", [
    (1024, 1024, 1.0), (1024, 512, 3 / 4), (1024, 256, 10 / 16), (4096, 512, 36 / 64)])
def test_splash_causal_block_fraction(seq_len, block, fraction):
  assert splash_attention.causal_block_fraction(seq_len, block, block) == pytest.approx(fraction)


def test_splash_kernel_rule_counts_each_matmul():
  q = ("bf16", (2, 4, 1024, 256))
  v = ("bf16", (2, 4, 1024, 128))
  operands = [("s8", (1, 1, 1)), q, q, v, ("s32", (2, 1024))]
  pairs = 2 * 4 * 1024 * 1024 * (3 / 4)  # batch x heads x T x T x causal block fraction
  fwd = splash_attention.splash_kernel_flops("splash_mha_fwd_segmented", operands, "")
  dkv = splash_attention.splash_kernel_flops("splash_mha_dkv_segmented", operands, "")
  assert fwd == 2 * pairs * (256 + 128)  # default blocks at T=1024 are 512: 3/4 computed
  assert dkv == 2 * pairs * (2 * 256 + 2 * 128)
  # The fused backward's dkv kernel also returns dq (per kv block): one more q.k-sized matmul.
  fused_results = [("f32", (2, 2, 4, 1024, 256)), q, v]
  fused = splash_attention.splash_kernel_flops("splash_mha_dkv_segmented", operands, "",
                                               fused_results)
  assert fused == 2 * pairs * (3 * 256 + 2 * 128)
  assert splash_attention.splash_kernel_flops("splash_mha_dkv_segmented", operands, "",
                                              [q, v]) == dkv


def test_gmm_cost_rows_count_expected_rows_and_boundary_slabs():
  from pallas_kernels.gmm_kernel import mxu_rows  # pylint: disable=import-outside-toplevel
  assert mxu_rows(None, 4096, 128, 1) == 4096
  assert mxu_rows(None, 4096, 128, 16) == 4096 + 15 * 128  # one slab per group boundary
  assert mxu_rows(2000, 4096, 128, 16) == 2048 + 15 * 128  # a capacity buffer, partly filled
  assert mxu_rows(9999, 4096, 256, 4) == 4096 + 3 * 256
