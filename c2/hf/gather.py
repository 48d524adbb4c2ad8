"""Slices of (sharded, possibly multi-process) jax.Arrays brought to this host, one at a time.

The streaming export (c2.hf.checkpoint.export_checkpoint) walks a model layer by layer and expert
by expert; each slice is cut on the devices that hold it and gathered replicated, so host memory
holds one slice, never a leaf, and the same code runs on one host or on every host of a pod.

The cut is explicit (shard_map): a dynamic_slice of a sharded leaf left to the SPMD partitioner
all-gathered the whole leaf along its sharded leading dimensions first (every expert of every
layer on every device, in float32, for each single expert taken), which peaked at 1.77 GB per
process exporting a 0.28 GB checkpoint, and cannot fit at all for a real model.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


def host_slice(leaf, index: tuple[int, ...], chunk_bytes: int = 8 << 20) -> np.ndarray:
  """leaf[index] on this host as numpy. A jax.Array (sharded, possibly over several processes) is
  sliced on its devices and gathered to a replicated result, one compiled program per leaf shape
  and sharding (the index is a traced argument), so only the slice ever reaches host memory;
  every process must call it in the same order. A slice above `chunk_bytes` comes over in row
  blocks of at most that size (within one shard each): the gather's transient is a few replicas
  of the block on every local device (XLA:CPU widens bf16 to float32 for it), which for a whole
  64 MB embedding on 8 CPU devices had peaked at 2.4 GB."""
  if not isinstance(leaf, jax.Array):
    return np.asarray(leaf[index] if index else leaf)
  depth = len(index)
  sharding = leaf.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):  # one device: nothing to gather
    return np.asarray(_local_slicer(depth)(leaf, np.asarray(index, np.int32).reshape(depth)))
  spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
  rest = leaf.shape[depth:]
  rows = _block_rows(leaf, depth, spec, sharding.mesh, chunk_bytes)
  if rows is None:
    out = _sharded_slicer(depth, sharding.mesh, spec, leaf.shape, None)(
        leaf, np.asarray(index, np.int32).reshape(depth))
    return np.asarray(out.addressable_data(0))
  result = np.empty(rest, leaf.dtype)
  take = _sharded_slicer(depth, sharding.mesh, spec, leaf.shape, rows)
  for start in range(0, rest[0], rows):
    out = take(leaf, np.asarray(tuple(index) + (start,), np.int32))
    result[start:start + rows] = np.asarray(out.addressable_data(0))
    del out
  return result


def _block_rows(leaf, depth: int, spec: tuple, mesh, chunk_bytes: int) -> Optional[int]:
  """Rows of the slice's first dim per gather (None: the whole slice at once): the most that fit
  `chunk_bytes` among divisors of that dim's shard size, so a block never spans two shards."""
  rest = leaf.shape[depth:]
  row_bytes = int(np.prod(rest[1:], dtype=np.int64)) * leaf.dtype.itemsize
  if not rest or row_bytes * rest[0] <= chunk_bytes:
    return None
  shards = int(np.prod([mesh.shape[a] for a in _axes(spec[depth])], dtype=np.int64))
  local = rest[0] // shards
  fitting = [r for r in range(1, local + 1) if local % r == 0 and r * row_bytes <= chunk_bytes]
  return max(fitting, default=1)


@functools.lru_cache(maxsize=None)
def _local_slicer(depth: int):
  def take(a, idx):  # a [*lead, *rest] -> a[idx] [*rest]
    starts = [idx[i] for i in range(depth)] + [0] * (a.ndim - depth)
    return jax.lax.dynamic_slice(a, starts, (1,) * depth + a.shape[depth:]).reshape(
        a.shape[depth:])
  return jax.jit(take)


def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@functools.lru_cache(maxsize=None)
def _sharded_slicer(depth: int, mesh, spec: tuple, shape: tuple[int, ...], rows: Optional[int]):
  """jit(a, idx -> a[idx] replicated) for a leaf of `shape` sharded as `spec` on `mesh`; with
  `rows`, idx has one more entry, a start row s, and the result is a[idx][s:s + rows] (the rows
  within one shard of that dim).

  Each device cuts the slice from its own block when that block holds it (zeros otherwise); a sum
  over the mesh axes sharding the cut dims (of the bit patterns as integers, so that it is exact,
  -0.0 included) leaves every device the slice's part it holds in the remaining dims, and an
  all-gather over their axes completes it.
  """
  cut = depth + (rows is not None)  # dims cut here: the indexed ones, then the row block
  sizes = (1,) * depth + ((rows,) if rows is not None else ())
  cut_axes = tuple(a for entry in spec[:cut] for a in _axes(entry))
  words = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}

  def local(block, idx):
    hit, starts = True, []
    for d in range(cut):
      axes = _axes(spec[d])
      offset = jax.lax.axis_index(axes) * block.shape[d] if axes else 0
      i = idx[d] - offset
      hit = hit & (i >= 0) & (i + sizes[d] <= block.shape[d])
      starts.append(jnp.clip(i, 0, block.shape[d] - sizes[d]))
    piece = jax.lax.dynamic_slice(block, starts + [0] * (block.ndim - cut),
                                  sizes + block.shape[cut:])
    piece = piece.reshape(piece.shape[depth:])  # drop the indexed dims
    if cut_axes:
      word = words[piece.dtype.itemsize]
      as_bits = jnp.where(hit, jax.lax.bitcast_convert_type(piece, word), 0)
      summed = jax.lax.psum(as_bits.astype(jnp.uint32) if word == jnp.uint8 else as_bits,
                            cut_axes)
      piece = jax.lax.bitcast_convert_type(summed.astype(word), piece.dtype)
    for d, entry in enumerate(spec[cut:], start=cut - depth):
      if _axes(entry):
        piece = jax.lax.all_gather(piece, _axes(entry), axis=d, tiled=True)
    return piece

  # Replicated by construction (psum, then all_gather): all_gather's result counts as varying
  # for the replication check, so the check is off.
  sliced = jax.shard_map(local, mesh=mesh, in_specs=(P(*spec), P()), out_specs=P(),
                         check_vma=False)
  return jax.jit(sliced, out_shardings=jax.sharding.NamedSharding(mesh, P()))
