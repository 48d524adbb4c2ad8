"""An Orbax PyTree checkpoint written slice by slice: no leaf is ever whole in host memory.

  save_sliced(directory, tree_of_SlicedLeaf, progress=bar)

The offline conversion (c2.hf.convert import) of the real Kimi release cannot build a leaf and
hand it to Orbax: one stacked expert projection is 60 layers x 384 experts x 7168 x 2048, 676 GB
in bf16. A `SlicedLeaf` is the leaf's shape, dtype and a function that builds any slice of it;
Orbax's own save walks the tree and a type handler registered here for `SlicedLeaf` opens the
leaf's TensorStore array with the spec Orbax's `ArrayHandler` would use (same OCDBT store, same
zarr metadata, same array-metadata records) and writes it one slice at a time. Restoring is
plain Orbax: the checkpoint is indistinguishable from one saved from `jax.Array`s (the leaves'
typestr is `jax.Array`), so `ocp.StandardCheckpointer().restore(dir, abstract)` and
`train.init_from` read it with any sharding.

Memory: the slice being written plus `prefetch` slices built ahead (by a thread, so reading and
dequantising the next slice overlaps TensorStore's write of this one), plus TensorStore's write
buffers of about one chunk. Each slice is one zarr chunk, so writes never read-modify-write.

This leans on Orbax internals pinned by setup.py (orbax-checkpoint 0.12.8): the handler calls
`tensorstore_utils.build_array_write_spec`, as `ArrayHandler` does. The round trip is tested
(tests/hf/test_orbax_stream.py), so a version bump that changes them fails loudly.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.futures import future as ocp_future
from orbax.checkpoint._src.serialization import jax_array_handlers
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils
from orbax.checkpoint._src.serialization import type_handler_registry
from orbax.checkpoint._src.serialization import types as ocp_types

Index = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class SlicedLeaf:
  """A leaf to save: `build(index)` returns its slice `index` as a numpy array of `dtype`."""

  shape: tuple[int, ...]
  dtype: np.dtype
  slice_shape: tuple[int, ...]  # every slice but the last along a dim has this shape
  build: Callable[[Index], np.ndarray]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

  @property
  def slice_nbytes(self) -> int:
    return int(np.prod(self.slice_shape)) * np.dtype(self.dtype).itemsize

  def indices(self) -> Iterator[Index]:
    """The slices in row-major order; together they tile the leaf exactly once."""
    starts = [range(0, n, c) for n, c in zip(self.shape, self.slice_shape)]
    for corner in itertools.product(*starts):
      yield tuple(slice(s, min(s + c, n)) for s, c, n in zip(corner, self.slice_shape, self.shape))


def slice_shape(shape: Sequence[int], itemsize: int, max_bytes: int) -> tuple[int, ...]:
  """The largest row-major block of `shape` within `max_bytes`: trailing dims whole, then as
  many rows of the next dim as fit, leading dims 1 (at least one element of every dim).

  For our leaves this follows the HF layout: one stacked layer, then a run of routed experts of
  it, then rows of one expert's matrix, so each slice reads few HF tensors."""
  out, inner = [1] * len(shape), itemsize
  for d in reversed(range(len(shape))):
    rows = max(1, min(shape[d], max_bytes // inner))
    out[d] = rows
    if rows < shape[d]:
      break
    inner *= shape[d]
  return tuple(out)


class _SlicedLeafHandler(jax_array_handlers.ArrayHandler):
  """Orbax's ArrayHandler for `SlicedLeaf` values: the same files, written slice by slice. The
  inherited typestr ("jax.Array") goes into the metadata, so the checkpoint is a plain one."""

  def __init__(self, *, progress=None, prefetch: int = 1, **kwargs):
    super().__init__(**kwargs)
    self._progress, self._prefetch = progress, prefetch

  async def _write(self, leaf: SlicedLeaf, info, arg) -> Any:
    await info.await_path_creation()
    spec = tensorstore_utils.build_array_write_spec(
        info=info, arg=arg, global_shape=leaf.shape, local_shape=leaf.slice_shape,
        dtype=leaf.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
        process_index=ocdbt_utils.get_process_index_for_subdir(info.is_ocdbt_checkpoint))
    array = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
    indices = list(leaf.indices())
    # Slices built ahead in threads (numpy and the file reads release the GIL), so the next
    # slice's read and dequantisation overlap this slice's write.
    built = [asyncio.ensure_future(asyncio.to_thread(leaf.build, where))
             for where in indices[:self._prefetch + 1]]  # this slice and `prefetch` more
    for i, where in enumerate(indices):
      block = await built[i]
      built[i] = None  # dropped once written
      want = tuple(s.stop - s.start for s in where)
      if block.shape != want or block.dtype != np.dtype(leaf.dtype):
        raise ValueError(f"{info.name}: slice {where} built as {block.dtype}{list(block.shape)}, "
                         f"expected {np.dtype(leaf.dtype)}{list(want)}")
      await array[where].write(block)
      if self._progress is not None:
        self._progress.update(block.nbytes)
      del block
      if i + self._prefetch + 1 < len(indices):
        built.append(asyncio.ensure_future(asyncio.to_thread(
            leaf.build, indices[i + self._prefetch + 1])))
    return spec.metadata

  async def serialize(self, values: Sequence[SlicedLeaf], infos: Sequence[ocp_types.ParamInfo],
                      args: Optional[Sequence[ocp_types.SaveArgs]] = None
                      ) -> list[ocp_future.Future]:
    args = args or [ocp_types.SaveArgs()] * len(values)

    async def write_all():
      metadatas = [await self._write(leaf, info, arg)  # one leaf at a time: bounded memory
                   for leaf, info, arg in zip(values, infos, args)]
      if self._array_metadata_store is not None:
        await self._array_metadata_store.write(
            checkpoint_dir=infos[0].parent_dir, array_metadatas=metadatas,
            process_index=jax.process_index())

    return [ocp_future.CommitFutureAwaitingContractedSignals(write_all(), name="sliced_leaves")]


def save_sliced(directory: str, tree: Any, *, progress=None, prefetch: int = 1) -> None:
  """Saves a pytree whose leaves are all `SlicedLeaf`s as an Orbax PyTree checkpoint at
  `directory` (which must not exist; Orbax writes it under a temporary name and renames it when
  complete). progress: anything with .update(nbytes), e.g. a tqdm bar."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, SlicedLeaf))
  if not all(isinstance(leaf, SlicedLeaf) for leaf in leaves):
    # A plain array would go to Orbax's ArrayHandler, whose array-metadata file for this
    # process would then replace ours (one file per process).
    raise TypeError("save_sliced: every leaf must be a SlicedLeaf")
  standard = type_handler_registry.create_type_handler_registry(
      *type_handler_registry._DEFAULT_TYPE_HANDLERS)  # pylint: disable=protected-access
  store = standard.get(jax.Array)._array_metadata_store  # pylint: disable=protected-access
  handler = _SlicedLeafHandler(progress=progress, prefetch=prefetch, array_metadata_store=store)
  registry = type_handler_registry.create_type_handler_registry(
      (SlicedLeaf, handler), *type_handler_registry._DEFAULT_TYPE_HANDLERS)  # pylint: disable=protected-access
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry)) as ckptr:
    ckptr.save(directory, args=ocp.args.PyTreeSave(tree))
