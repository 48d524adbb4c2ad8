"""The slice-by-slice Orbax writer (c2/hf/orbax_stream.py): what it writes is a plain Orbax
checkpoint, equal bit for bit to the leaves it was built from, written one slice at a time."""
import threading

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from c2.hf.orbax_stream import SlicedLeaf, save_sliced, slice_shape
from c2.parallel.mesh import make_mesh


def test_slice_shape_keeps_trailing_dims_whole_then_rows_of_the_next():
  # [layers, experts, in, out] bf16: one expert is 2 x 3 x 4 = 24 bytes... with 100 bytes, 4
  # experts of one layer; with 20 bytes, rows of one expert's matrix; with 1 byte, one element.
  assert slice_shape((5, 7, 3, 4), 2, 100) == (1, 4, 3, 4)
  assert slice_shape((5, 7, 3, 4), 2, 20) == (1, 1, 2, 4)
  assert slice_shape((5, 7, 3, 4), 2, 1) == (1, 1, 1, 1)
  assert slice_shape((5, 7, 3, 4), 2, 10**6) == (5, 7, 3, 4)
  assert slice_shape((5, 7, 3, 4), 2, 7 * 3 * 4 * 2 * 2) == (2, 7, 3, 4)


def test_slices_tile_the_leaf_exactly_once():
  leaf = SlicedLeaf((5, 7, 3), np.dtype(np.float32), (2, 3, 3), lambda index: None)
  seen = np.zeros(leaf.shape, np.int32)
  for index in leaf.indices():
    seen[index] += 1
  np.testing.assert_array_equal(seen, 1)
  assert len(list(leaf.indices())) == 3 * 3


def _sliced(value: np.ndarray, max_bytes: int, log: list) -> SlicedLeaf:
  lock = threading.Lock()

  def build(index):
    with lock:
      log.append((value.shape, index))
    return np.array(value[index])  # a copy, as the HF reader returns

  return SlicedLeaf(value.shape, value.dtype, slice_shape(value.shape, value.dtype.itemsize,
                                                          max_bytes), build)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_round_trip_is_bit_exact_and_restores_with_any_sharding(tmp_path, prefetch):
  rng = np.random.default_rng(0)
  experts = rng.standard_normal((3, 8, 6, 10)).astype(ml_dtypes.bfloat16)
  experts.view(np.uint16)[0, 0, 0, :2] = [0x8000, 0x7FC1]  # -0.0 and a NaN payload survive
  values = {"moe": {"up": experts, "bias": rng.standard_normal(5).astype(np.float32)},
            "embed": rng.standard_normal((12, 8)).astype(np.float32)}
  log: list = []
  tree = jax.tree.map(lambda v: _sliced(v, 240, log), values)
  written = []

  class Progress:
    def update(self, nbytes):
      written.append(nbytes)

  save_sliced(str(tmp_path / "params"), tree, progress=Progress(), prefetch=prefetch)
  # Every slice built once; the bytes reported to the progress bar add up to the tree.
  assert len(log) == len(set(map(repr, log)))
  # An expert is 6 x 10 x 2 = 120 bytes: two per slice, 3 layers x 4 slices.
  built = [index for shape, index in log if shape == experts.shape]  # threads: any order
  assert sorted((i[0].start, i[1].start, i[1].stop, i[2], i[3]) for i in built) == [
      (layer, e, e + 2, slice(0, 6), slice(0, 10)) for layer in range(3) for e in (0, 2, 4, 6)]
  assert sum(written) == sum(v.nbytes for v in jax.tree.leaves(values))
  mesh = make_mesh({"fsdp": 4, "tensor": 2})
  spec = jax.sharding.PartitionSpec
  shardings = {"moe": {"up": jax.sharding.NamedSharding(mesh, spec(None, "fsdp", None, "tensor")),
                       "bias": jax.sharding.NamedSharding(mesh, spec())},
               "embed": jax.sharding.NamedSharding(mesh, spec("tensor", "fsdp"))}
  target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                        values, shardings)
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(str(tmp_path / "params"), target)
  for (path, want), got, sharding in zip(jax.tree_util.tree_leaves_with_path(values),
                                        jax.tree.leaves(restored), jax.tree.leaves(shardings)):
    assert got.sharding.is_equivalent_to(sharding, got.ndim)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8),
                                  err_msg=jax.tree_util.keystr(path))


def test_a_slice_of_the_wrong_shape_names_the_leaf(tmp_path):
  leaf = SlicedLeaf((4, 4), np.dtype(np.float32), (2, 4), lambda index: np.zeros((3, 4), np.float32))
  with pytest.raises(ValueError, match=r"moe\.up.*slice.*built as float32\[3, 4\], expected "
                                       r"float32\[2, 4\]"):
    save_sliced(str(tmp_path / "params"), {"moe": {"up": leaf}})
  assert not (tmp_path / "params").exists()  # Orbax renames only a complete checkpoint


def test_plain_arrays_are_refused(tmp_path):
  with pytest.raises(TypeError, match="every leaf must be a SlicedLeaf"):
    save_sliced(str(tmp_path / "params"), {"w": np.zeros(3)})
