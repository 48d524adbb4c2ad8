"""Import of a Hugging Face checkpoint straight into sharded jax.Arrays, never whole on one host.

  import_sharded(hf_dir, mesh, dtype=np.float32) -> (ModelConfig, params of global jax.Arrays)

Every process reads only the slices its own devices hold: for each of our leaves the leaf's
NamedSharding (c2.model.param_shardings) gives each addressable device's index; that index is
mapped back to rows and columns of the HF tensors behind it (one HF tensor per stacked layer and
per routed expert, HF Linear [O, I] transposed into our [I..., O...]), which are read from the
safetensors files row range by row range (TensorStore.read_index) and dequantised per quantisation
block (INT4 group 32 / FP8 128x128: only the blocks covering the slice are read). Devices with the
same index (replicated dims) share one read. Works unchanged across processes: each process holds
the addressable shards of a global array (jax.make_array_from_single_device_arrays).

Memory: besides the shards being placed on devices, the host holds one device block of one leaf
(built one stacked layer at a time) plus one read chunk (64 MB): the bound stated in the README
is peak RSS <= resident device bytes + 3x the largest device block + a constant.

Values are bit-identical to `c2.hf.checkpoint.import_checkpoint`: the same dequantisers run on
the same blocks, assembled in float32 and rounded once to the target dtype.
"""
from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import jax
import numpy as np

from c2 import model as model_lib
from c2.hf import checkpoint as hf
from c2.hf.orbax_stream import SlicedLeaf, slice_shape
from c2.hf.progress import progress_bar
from c2.hf.tensors import CheckpointError, TensorStore
from c2.model.config import ModelConfig

Params = Any


def _indices(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[np.ndarray]:
  return [np.arange(*s.indices(n)) for s, n in zip(index, shape)]


def _flat(index: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray:
  """Row-major flat positions of the block `index` of an array of `shape` (ascending)."""
  return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)[index].ravel()


def _linear_block(store: TensorStore, module: str, in_dims: int, index: tuple[slice, ...],
                  shape: tuple[int, ...]) -> np.ndarray:
  """Our block `index` of a leaf of (per-layer) `shape` [I..., O...] <- HF Linear [O, I]^T."""
  o, i = int(np.prod(shape[in_dims:])), int(np.prod(shape[:in_dims]))
  stored = store.linear_shape(module)
  if stored != (o, i):
    raise CheckpointError(f"{module}: [out, in] = {stored}, expected {(o, i)} for our per-layer "
                          f"shape {shape}; config.json and the weights disagree")
  rows = _flat(index[in_dims:], shape[in_dims:])
  cols = _flat(index[:in_dims], shape[:in_dims])
  block_shape = tuple(len(ix) for ix in _indices(index, shape))
  return store.linear_select(module, rows, cols).T.reshape(block_shape)  # [I.., O..] block


def _block(store: TensorStore, prefix: str, spec, index: tuple[slice, ...],
           shape: tuple[int, ...]) -> np.ndarray:
  """One layer's block `index` of our leaf (per-layer `shape`), float32 or as stored."""
  name, kind = spec
  if kind is None:
    if store.shape(prefix + name) != shape:
      raise CheckpointError(f"{prefix + name}: shape {store.shape(prefix + name)}, expected "
                            f"{shape}; config.json and the weights disagree")
    return store.read_index(prefix + name, tuple(_indices(index, shape)))
  if kind != "experts":
    return _linear_block(store, prefix + name, kind, index, shape)
  experts, a, b = _indices(index, shape)  # our [E, A, B] = HF [E][B, A]^T
  fused = prefix + "mlp.experts." + ("down_proj" if name == "down_proj" else "gate_up_proj")
  if fused in store:  # transformers' in-memory layout: [E, 2F, D] (gate then up) / [E, D, F]
    offset = shape[2] if name == "up_proj" else 0
    return np.swapaxes(store.read_index(fused, (experts, b + offset, a)), 1, 2).astype(np.float32)
  return np.stack([_linear_block(store, f"{prefix}mlp.experts.{e}.{name}", 1, index[1:],
                                 shape[1:]) for e in experts])


def _leaf_block(store: TensorStore, root: str, plan, index: tuple[slice, ...],
                dtype: np.dtype, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
  """The device block `index` of one of our leaves, in `dtype`, built one layer at a time (by
  the pool's threads in parallel when given: numpy's unpacking and casts release the GIL)."""
  _, leaf, prefixes, spec, stacked = plan
  shape = tuple(leaf.shape)
  block = np.empty(tuple(len(ix) for ix in _indices(index, shape)), dtype)
  if not stacked:
    block[...] = _block(store, root + prefixes[0], spec, index, shape)
    return block

  def fill(k_layer):
    k, layer = k_layer
    block[k] = _block(store, root + prefixes[layer], spec, index[1:], shape[1:])

  layers = list(enumerate(_indices(index, shape)[0]))
  list(pool.map(fill, layers) if pool is not None else map(fill, layers))
  return block


def _read_block(store: TensorStore, root: str, plan, index: tuple[slice, ...], dtype: np.dtype,
                pool: ThreadPoolExecutor | None = None) -> np.ndarray:
  """_leaf_block in float32 (per layer), rounded once to `dtype` as the single-host import
  does; a mismatch names our parameter and the config.json fields behind its shape."""
  path, leaf = plan[0], plan[1]
  try:
    return _leaf_block(store, root, plan, index, np.dtype(np.float32), pool).astype(dtype,
                                                                                   copy=False)
  except CheckpointError as e:
    raise CheckpointError(f"{e} [our parameter {'/'.join(path)}, shape {tuple(leaf.shape)} "
                          f"from {hf_config_fields(path)} in config.json]") from e


def hf_config_fields(path: tuple[str, ...]) -> str:
  """The config.json fields that set the shape of our leaf `path` (for error messages)."""
  name = path[-2] if path[-1] in ("scale", "embedding") else path[-1]
  fields = {"gate": "hidden_size, moe_intermediate_size / intermediate_size",
            "up": "hidden_size, moe_intermediate_size / intermediate_size",
            "down": "moe_intermediate_size / intermediate_size, hidden_size",
            "router": "hidden_size, n_routed_experts", "correction_bias": "n_routed_experts",
            "embed": "vocab_size, hidden_size", "lm_head": "hidden_size, vocab_size",
            "q_a": "hidden_size, q_lora_rank", "kv_a": "hidden_size, kv_lora_rank, qk_rope_head_dim",
            "q_b": "q_lora_rank, num_attention_heads, qk_nope_head_dim + qk_rope_head_dim",
            "q": "hidden_size, num_attention_heads, qk_nope_head_dim + qk_rope_head_dim",
            "kv_b": "kv_lora_rank, num_attention_heads, qk_nope_head_dim + v_head_dim",
            "out": "num_attention_heads, v_head_dim, hidden_size", "eh_proj": "2 x hidden_size"}
  return fields.get(name, "hidden_size and the layer counts")


def _key(index: tuple[slice, ...]) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


def import_sharded(hf_dir: str, mesh: jax.sharding.Mesh, *, dtype=np.float32,
                   compute_dtype: str | None = None, progress: bool = False,
                   shardings: Params | None = None, workers: int = 1, **config_overrides
                   ) -> tuple[ModelConfig, Params]:
  """Reads an HF checkpoint into global jax.Arrays sharded over `mesh` (every process calls it).

  dtype / compute_dtype / config_overrides as in c2.hf.checkpoint.import_checkpoint.
  shardings: a NamedSharding per leaf (default c2.model.param_shardings(cfg, mesh)), e.g. the
  trainer's state shardings. workers: layers read and dequantised in parallel threads.
  Returns (cfg, params); `import_sharded.stats` of the last call holds
  bytes read from disk, bytes placed on this process's devices and seconds, for throughput.
  """
  cfg, store, root = hf.open_checkpoint(hf_dir, dtype=dtype, compute_dtype=compute_dtype,
                                        **config_overrides)
  params: dict = {}
  for path, array in import_leaves(cfg, store, root, mesh, dtype=dtype, progress=progress,
                                   shardings=shardings, workers=workers):
    hf.set_leaf(params, path, array)
  return cfg, params


def import_leaves(cfg: ModelConfig, store: TensorStore, root: str, mesh: jax.sharding.Mesh, *,
                  dtype=np.float32, progress: bool = False, shardings: Params | None = None,
                  workers: int = 1) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
  """(our path, global jax.Array) leaf by leaf, for a consumer that saves each and drops it
  (c2.hf.convert): then only one leaf's shards are ever resident. Arguments from
  c2.hf.checkpoint.open_checkpoint; see import_sharded. workers > 1 builds that many layers of a
  block at once (host memory: the block plus `workers` layers in flight)."""
  start, read_before = time.perf_counter(), store.bytes_read
  # Leaves the given shardings lack (e.g. MTP layers the caller's model has not) get the rules'.
  flat_shardings = dict(hf._leaves(model_lib.param_shardings(cfg, mesh)))  # pylint: disable=protected-access
  if shardings is not None:
    flat_shardings.update(hf._leaves(shardings))  # pylint: disable=protected-access
  work = []
  for plan in hf.leaf_plans(cfg):
    path, leaf = plan[0], plan[1]
    sharding = flat_shardings[path]
    groups: dict[tuple, list] = {}  # one read per distinct block; replicas share it
    for device, index in sharding.addressable_devices_indices_map(tuple(leaf.shape)).items():
      groups.setdefault(_key(index), [index, []])[1].append(device)
    work.append((plan, sharding, list(groups.values())))
  block_bytes = lambda plan, index: int(np.prod([len(ix) for ix in _indices(
      index, tuple(plan[1].shape))])) * hf.import_dtype(plan[0], dtype).itemsize
  total = sum(block_bytes(plan, index) for plan, _, groups in work for index, _ in groups)
  bar = progress_bar(progress, total, f"import (process {jax.process_index()})")
  pool = ThreadPoolExecutor(workers) if workers > 1 else None
  placed = 0
  for plan, sharding, groups in work:
    path, leaf = plan[0], plan[1]
    leaf_dtype = hf.import_dtype(path, dtype)
    shards = []
    for index, devices in groups:
      block = _read_block(store, root, plan, index, leaf_dtype, pool)
      shards.extend(jax.device_put(block, d) for d in devices)
      placed += block.nbytes * len(devices)
      bar.update(block.nbytes)
      del block
    import_sharded.stats = {"bytes_read": store.bytes_read - read_before, "bytes_placed": placed,
                            "seconds": time.perf_counter() - start}
    yield path, jax.make_array_from_single_device_arrays(tuple(leaf.shape), sharding, shards)
    del shards
  bar.close()
  if pool is not None:
    pool.shutdown()


import_sharded.stats = {}


def sliced_leaves(cfg: ModelConfig, store: TensorStore, root: str, *, dtype=np.float32,
                  max_slice_bytes: int = 256 << 20) -> Iterator[tuple[tuple[str, ...], SlicedLeaf]]:
  """(our path, SlicedLeaf) for every leaf, for the offline conversion (c2.hf.orbax_stream): no
  mesh and no leaf in memory; each slice (at most `max_slice_bytes` in the target dtype, or one
  row of the innermost dim) is read and dequantised from the HF tensors when it is written."""
  for plan in hf.leaf_plans(cfg):
    path, leaf = plan[0], plan[1]
    leaf_dtype = np.dtype(hf.import_dtype(path, dtype))
    shape = tuple(leaf.shape)
    yield path, SlicedLeaf(shape, leaf_dtype, slice_shape(shape, leaf_dtype.itemsize,
                                                          max_slice_bytes),
                           functools.partial(_read_block, store, root, plan, dtype=leaf_dtype))
