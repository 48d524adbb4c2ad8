"""AOT-compile the kernels for v5e, v5p, v6e and TPU7x from this CPU host (needs libtpu).

Each compile is a tiny shape (a few tiles), so Mosaic runs in a second or two per program. The
ShapeDtypeStructs carry a TPU SingleDeviceSharding: without one, .lower() silently targets CPU.
The default suite compiles each generation's chosen paths; the slow matrix also forces the
alternative paths (e4m3 into the MXU on v5e/v5p/v6e, dequantised fp8 and packed fp4 on TPU7x).
"""
import dataclasses
import functools
import os

import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install 'jax[tpu]')")
# No TPU is attached, so concurrent libtpu loads (pytest-xdist, other users) are harmless;
# without this a second process fails on /tmp/libtpu_lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import operands, tuning  # noqa: E402

pytestmark = pytest.mark.tpu_aot
TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}
M, K, N, G = 384, 512, 256, 3


@functools.lru_cache(maxsize=None)
def _sharding(gen):
  device = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[gen]).devices[0]
  return jax.sharding.SingleDeviceSharding(device)


def _sds(gen, shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=_sharding(gen))


def _compile(gen, fn, *shapes):
  compiled = jax.jit(fn).lower(*(_sds(gen, s, d) for s, d in shapes)).compile()
  return compiled, compiled.as_text()


def _train_step_shapes():
  return ((M, K), jnp.bfloat16), ((G, K, N), jnp.bfloat16), ((G,), jnp.int32)


def _composer_step(target, fmt="nvfp4", bwd_fmt="mxfp8"):
  """Loss gradient through gmm: the forward kernel plus both backward kernels."""
  def loss(lhs, rhs, gs):
    out = pk.gmm(lhs, rhs, gs, fmt=fmt, bwd_fmt=bwd_fmt, target=target)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return jax.value_and_grad(loss, argnums=(0, 1))


@pytest.mark.parametrize("gen", sorted(TOPOLOGIES))
def test_composer_split_compiles(gen):
  """NVFP4 forward + MXFP8 backward, and an FP8 forward, with the generation's chosen paths."""
  compiled, hlo = _compile(gen, _composer_step(gen), *_train_step_shapes())
  assert hlo.count("tpu_custom_call") == 3  # gmm fwd, gmm d_lhs, tgmm d_rhs
  mem = compiled.memory_analysis()
  assert mem.temp_size_in_bytes < 64 << 20 and compiled.cost_analysis()["flops"] > 0
  _, hlo = _compile(gen, lambda a, b, g: pk.gmm(a, b, g, fmt="fp8", target=gen),
                    *_train_step_shapes())
  assert hlo.count("tpu_custom_call") == 1


def _mosaic_accepts(gen, dtype, upcast=False):
  def kernel(x_ref, y_ref, o_ref):
    x, y = x_ref[...], y_ref[...]
    if upcast:
      x, y = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)
    o_ref[...] = operands.mxu_dot(x, y)
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32))
  try:
    _compile(gen, call, ((256, 256), dtype), ((256, 256), dtype))
    return True
  except Exception as e:  # noqa: BLE001 - Mosaic reports unsupported types as runtime errors
    if "Mosaic" not in str(e) and "Unsupported" not in str(e):
      raise
    return False


@pytest.mark.parametrize("gen", sorted(TOPOLOGIES))
def test_native_formats_match_the_generation_table(gen):
  """Which element types Mosaic takes into a dot (raw) or even loads into VMEM (upcast)."""
  table = tuning.GENERATIONS[gen]
  assert _mosaic_accepts(gen, jnp.float8_e4m3fn)  # accepted everywhere (cast where not native)
  assert _mosaic_accepts(gen, jnp.float4_e2m1fn) == (gen == "tpu7x")
  assert _mosaic_accepts(gen, jnp.float4_e2m1fn, upcast=True) == table.fp4_in_vmem


FORCED = {  # the paths a generation does not choose by default
    "native-e4m3": lambda g: dataclasses.replace(g, native_mxu_dtypes=frozenset({"float8_e4m3fn"})),
    "dequant-e4m3": lambda g: dataclasses.replace(g, native_mxu_dtypes=frozenset()),
    "packed-fp4": lambda g: dataclasses.replace(g, fp4_in_vmem=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("gen", sorted(TOPOLOGIES))
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("path", ["default", *FORCED])
def test_full_matrix_compiles(gen, fmt, path):
  target = tuning.GENERATIONS[gen] if path == "default" else FORCED[path](tuning.GENERATIONS[gen])
  _, hlo = _compile(gen, _composer_step(target, fmt, fmt), *_train_step_shapes())
  assert hlo.count("tpu_custom_call") == 3
