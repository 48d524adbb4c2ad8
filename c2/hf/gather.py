"""Slices of (sharded, possibly multi-process) jax.Arrays brought to this host, one at a time.

The streaming export (c2.hf.checkpoint.export_checkpoint) walks a model layer by layer and expert
by expert; each slice is cut on the devices that hold it and gathered replicated, so host memory
holds one slice, never a leaf, and the same code runs on one host or on every host of a pod.
"""
from __future__ import annotations

import functools

import jax
import numpy as np


def host_slice(leaf, index: tuple[int, ...]) -> np.ndarray:
  """leaf[index] on this host as numpy. A jax.Array (sharded, possibly over several processes) is
  sliced on its devices and gathered to a replicated result, one compiled program per leaf shape
  (the index is a traced argument), so only the slice ever reaches host memory; every process
  must call it in the same order."""
  if not isinstance(leaf, jax.Array):
    return np.asarray(leaf[index] if index else leaf)
  sharding = leaf.sharding
  replicated = (jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
                if isinstance(sharding, jax.sharding.NamedSharding) else None)
  out = _slicer(len(index), replicated)(leaf, np.asarray(index, np.int32).reshape(len(index)))
  return np.asarray(out.addressable_data(0))


@functools.lru_cache(maxsize=None)
def _slicer(depth: int, out_sharding):
  def take(a, idx):  # a [*lead, *rest] -> a[idx] [*rest]
    starts = [idx[i] for i in range(depth)] + [0] * (a.ndim - depth)
    sizes = (1,) * depth + a.shape[depth:]
    return jax.lax.dynamic_slice(a, starts, sizes).reshape(a.shape[depth:])
  return jax.jit(take, out_shardings=out_sharding)
