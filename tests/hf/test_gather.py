"""c2/hf/gather.py: slices of sharded arrays brought to the host equal numpy slicing bit for bit,
whatever the sharding, and only slice-sized data crosses devices (never the whole leaf)."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from c2.hf import gather
from c2.parallel.mesh import make_mesh

SPECS = [P(None, "expert", "fsdp", "tensor"), P(None, ("fsdp", "expert"), None, "tensor"),
         P("tensor", ("expert", "fsdp")), P(), P(None, None, ("fsdp", "tensor"), "expert")]


@pytest.fixture(scope="module")
def mesh():
  return make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})


def _values(dtype):
  x = np.random.RandomState(0).randn(6, 8, 16, 12).astype(dtype)
  x[0, 0, 0, 0] = -0.0  # summing bit patterns keeps the sign of zero
  return x


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("chunk_bytes", [1, 200, 8 << 20])  # row blocks of 1, a few, all rows
def test_slices_equal_numpy_bit_for_bit(mesh, spec, chunk_bytes):
  for dtype, word in ((ml_dtypes.bfloat16, np.uint16), (np.float32, np.uint32)):
    x = _values(dtype)
    leaf = jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    for index in [(0, 0), (5, 7), (3, 2), (1,), (4,), ()]:
      got = gather.host_slice(leaf, index, chunk_bytes=chunk_bytes)
      want = np.ascontiguousarray(x[index] if index else x)
      assert got.dtype == want.dtype and got.shape == want.shape
      np.testing.assert_array_equal(got.view(word), want.view(word), err_msg=f"{index}")


def test_unsharded_and_numpy_leaves():
  x = _values(np.float32)
  np.testing.assert_array_equal(gather.host_slice(jnp.asarray(x), (2, 3)), x[2, 3])
  np.testing.assert_array_equal(gather.host_slice(x, (2,)), x[2])


def test_only_slice_sized_data_is_gathered(mesh):
  """One expert of a stacked [layers, experts, D, F] leaf: the compiled program's collectives
  move at most that expert's matrix (float32 on CPU), where letting the partitioner slice the
  sharded leaf all-gathered every expert of every layer first."""
  shape, spec = (6, 8, 64, 48), (None, "expert", "fsdp", "tensor")
  leaf = jax.device_put(jnp.zeros(shape, jnp.bfloat16), NamedSharding(mesh, P(*spec)))
  text = gather._sharded_slicer(2, mesh, spec, shape, None).lower(  # pylint: disable=protected-access
      leaf, np.array([1, 3], np.int32)).compile().as_text()
  collectives = [line for line in text.splitlines()
                 if re.search(r"= \S+ (all-gather|all-reduce)\(", line)]
  assert collectives
  slice_elements = 64 * 48
  for line in collectives:
    dims = re.search(r"= \w+\[([\d,]*)\]", line).group(1)
    elements = int(np.prod([int(d) for d in dims.split(",") if d]))
    assert elements <= slice_elements, line[:160]
