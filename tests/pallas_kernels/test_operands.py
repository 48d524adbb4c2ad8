"""The kernel-side decoding (operands.decode) inverts the host-side layout exactly.

decode runs inside the Pallas kernels; here it runs as plain jnp on whole arrays (one tile), so
the E2M1 bit decoding, the nibble order of the packed layout and the 0/1-matmul block-scale
expansion are checked bit-for-bit against quant.dequantize without any kernel in the way.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import operands, quant


def _values_times_block_scales(q):
  """values * block scales (no row scale), exact in float32: what decode must return."""
  scales = np.asarray(q.scales.astype(jnp.float32))
  return np.asarray(q.values.astype(jnp.float32)) * np.repeat(scales, q.format.block, q.axis)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("fmt,packed", [("mxfp8", False), ("nvfp4", False), ("nvfp4", True)])
def test_decode_inverts_layout(fmt, packed, axis):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((256, 256)).astype(np.float32) * np.exp2(rng.integers(-8, 8, (256, 1)))
  f = quant.FORMATS[fmt]

  @jax.jit
  def run(x):
    q = quant.quantize(x, fmt, axis=axis)
    values = operands.pack_fp4(q.values, axis, 256) if packed else q.values
    return q, operands.decode(values, q.scales, f, axis=axis, packed=packed)

  q, decoded = run(jnp.asarray(x))
  np.testing.assert_array_equal(decoded, _values_times_block_scales(q))


def test_pack_fp4_nibble_order():
  """Byte j of a tile holds element j (low nibble) and element j + tile/2 (high nibble)."""
  codes = np.arange(16, dtype=np.uint8)
  values = jax.lax.bitcast_convert_type(jnp.asarray(np.tile(codes, 2)).astype(jnp.uint4),
                                        jnp.float4_e2m1fn)  # 32 elements, one tile
  packed = np.asarray(operands.pack_fp4(values.reshape(1, 32), 1, 32))[0]
  np.testing.assert_array_equal(packed & 15, codes)
  np.testing.assert_array_equal(packed >> 4, codes)


def test_e2m1_decode_table():
  codes = jnp.arange(16, dtype=jnp.int32)
  want = jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)
  np.testing.assert_array_equal(operands._decode_e2m1(codes), want.astype(jnp.float32))
