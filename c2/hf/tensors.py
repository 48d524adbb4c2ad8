"""Safetensors checkpoints on the host: a streaming reader, a sharded writer, and dequantisers.

The reader parses the safetensors header itself and reads one tensor at a time into a buffer it
owns (numpy + ml_dtypes, so bf16 and fp8 need neither torch nor the whole file in memory; once a
caller drops the array its memory is gone). Glossary: O output features (HF Linear rows),
I input features.

Dequantisers for the released Kimi checkpoints (../shared/research/algorithms.md §1.3):
  K2  block FP8:  weight f8e4m3 [O, I], weight_scale_inv f32 [ceil(O/128), ceil(I/128)];
                  w[o, i] = weight[o, i] * scale_inv[o // 128, i // 128]   (edge blocks partial)
  K2.5 INT4 compressed-tensors pack-quantized (symmetric, group 32 along I):
                  weight_packed i32 [O, I/8] (eight nibbles per word, lowest first),
                  weight_scale bf16 [O, I/32], weight_shape i32 [2] = (O, I);
                  w[o, i] = (nibble[o, i] - 8) * scale[o, i // 32]
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
    "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
  """A checkpoint directory or tensor that cannot be read as expected."""


def _read_header(path: str) -> tuple[dict, int]:
  with open(path, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
  header.pop("__metadata__", None)
  return header, 8 + size


class TensorStore:
  """Every tensor of an HF checkpoint directory (sharded with an index, or one file), by name."""

  def __init__(self, hf_dir: str):
    index_path, single = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
    _refuse_partial(hf_dir, index_path, single)
    if os.path.exists(index_path):
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.exists(single):
      files = [SINGLE_FILE]
    else:
      raise CheckpointError(f"{hf_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found; point at a "
                            "directory written by save_pretrained(safe_serialization=True)")
    self._entries: dict[str, tuple[str, dict, int]] = {}
    for name in files:
      path = os.path.join(hf_dir, name)
      if not os.path.exists(path):
        raise CheckpointError(f"{index_path} lists {name}, which is missing from {hf_dir}")
      header, data_start = _read_header(path)
      for key, info in header.items():
        self._entries[key] = (path, info, data_start)
    self.used: set[str] = set()
    self.bytes_read = 0  # from disk, for throughput figures
    self._count_lock = threading.Lock()  # the sharded importer reads from several threads
    self.fp8_block = (128, 128)  # quantization_config.weight_block_size
    self.int4_group = 32  # quantization_config.config_groups.*.weights.group_size

  def names(self) -> list[str]:
    return list(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._info(name)[1]["shape"])

  def dtype_name(self, name: str) -> str:
    """The stored dtype as safetensors names it: 'F32', 'BF16', 'F8_E4M3', 'I32', ..."""
    return self._info(name)[1]["dtype"]

  def _info(self, name: str):
    if name not in self._entries:
      raise CheckpointError(f"tensor {name!r} is not in the checkpoint")
    return self._entries[name]

  def read(self, name: str) -> np.ndarray:
    """The tensor as stored (its own buffer: no file mapping stays alive)."""
    path, info, data_start = self._info(name)
    if info["dtype"] not in _DTYPES:
      raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
    begin, end = info["data_offsets"]
    with open(path, "rb") as f:
      f.seek(data_start + begin)
      buf = f.read(end - begin)
    self._count(name, len(buf))
    return np.frombuffer(buf, _DTYPES[info["dtype"]]).reshape(info["shape"])

  def read_index(self, name: str, index: tuple[np.ndarray, ...],
                 chunk_bytes: int = 64 << 20) -> np.ndarray:
    """tensor[np.ix_(*index)] (one ascending index array per dim), reading from disk only the rows
    of dim 0 that index[0] spans, at most `chunk_bytes` at a time: memory stays at the result plus
    one chunk however large the tensor is."""
    path, info, data_start = self._info(name)
    if info["dtype"] not in _DTYPES:
      raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
    dtype, shape = np.dtype(_DTYPES[info["dtype"]]), tuple(info["shape"])
    if len(index) != len(shape):
      raise CheckpointError(f"{name}: rank {len(shape)} (shape {shape}), indexed with {len(index)}")
    rows = np.asarray(index[0], np.int64)
    if rows.size and (np.any(np.diff(rows) <= 0) or rows[0] < 0 or rows[-1] >= shape[0]):
      raise CheckpointError(f"{name}: rows {rows.min()}..{rows.max()} out of shape {shape}")
    rest = [np.asarray(i, np.int64) for i in index[1:]]
    for dim, (i, n) in enumerate(zip(rest, shape[1:]), start=1):
      if i.size and (i.min() < 0 or i.max() >= n):
        raise CheckpointError(f"{name}: index {i.min()}..{i.max()} out of range for dim {dim} "
                              f"of shape {shape}")
    out = np.empty((rows.size,) + tuple(i.size for i in rest), dtype)
    if not rows.size:
      return out
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    step = max(1, chunk_bytes // max(row_bytes, 1))
    begin, done = info["data_offsets"][0], 0
    with open(path, "rb") as f:
      for start in range(int(rows[0]), int(rows[-1]) + 1, step):
        stop = min(start + step, int(rows[-1]) + 1)
        picked = rows[done:][rows[done:] < stop]
        if not picked.size:
          continue
        f.seek(data_start + begin + start * row_bytes)
        buf = f.read((stop - start) * row_bytes)
        self._count(name, len(buf))
        chunk = np.frombuffer(buf, dtype).reshape((stop - start,) + shape[1:])
        out[done:done + picked.size] = _take(chunk, [picked - start] + rest)
        done += picked.size
    return out

  def _count(self, name: str, nbytes: int) -> None:
    with self._count_lock:
      self.used.add(name)
      self.bytes_read += nbytes

  def linear_shape(self, module: str) -> tuple[int, int]:
    """(O, I) of the Linear `module` as stored (INT4 packed: its weight_shape)."""
    if f"{module}.weight_packed" in self:
      return tuple(int(v) for v in self.read(f"{module}.weight_shape"))
    shape = self.shape(f"{module}.weight")
    if len(shape) != 2:
      raise CheckpointError(f"{module}.weight: shape {shape} is not a Linear [out, in]")
    return shape

  def linear_select(self, module: str, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """float32 [len(rows), len(cols)] = linear(module)[np.ix_(rows, cols)] (ascending indices),
    reading only the quantisation blocks that cover the selection. Each block is dequantised by
    the same function as `linear`, so the values are bit-identical to slicing its result."""
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    o, i = self.linear_shape(module)
    if f"{module}.weight_packed" in self:
      g = self.int4_group
      packed, scale = f"{module}.weight_packed", f"{module}.weight_scale"
      want = {packed: (o, -(-i // 8)), scale: (o, -(-i // g))}
      for name, shape in want.items():
        if self.shape(name) != shape:
          raise CheckpointError(f"{name}: shape {self.shape(name)}, expected {shape} for an INT4 "
                                f"weight of shape {(o, i)} in groups of {g} (quantization_config "
                                "group_size)")
      if g % 8:
        raise CheckpointError(f"{module}: INT4 group_size {g} is not a multiple of 8 (nibbles "
                              "per int32 word); the block cannot be sliced")
      lo, hi = int(cols[0]) // g * g, min(-(-(int(cols[-1]) + 1) // g) * g, i)  # whole groups
      block = dequantize_int4(
          self.read_index(packed, (rows, np.arange(lo // 8, -(-hi // 8)))),
          self.read_index(scale, (rows, np.arange(lo // g, -(-hi // g)))),
          (rows.size, hi - lo), g)
      return _take(block, [np.arange(rows.size), cols - lo])
    weight = f"{module}.weight"
    if self.dtype_name(weight).startswith("F8_"):
      if f"{module}.weight_scale_inv" not in self:
        raise CheckpointError(f"{weight} is FP8 but {module}.weight_scale_inv is missing")
      bo, bi = self.fp8_block
      r0, r1 = int(rows[0]) // bo * bo, min(-(-(int(rows[-1]) + 1) // bo) * bo, o)
      c0, c1 = int(cols[0]) // bi * bi, min(-(-(int(cols[-1]) + 1) // bi) * bi, i)
      block = dequantize_fp8_block(
          self.read_index(weight, (np.arange(r0, r1), np.arange(c0, c1))),
          self.read_index(f"{module}.weight_scale_inv",
                          (np.arange(r0 // bo, -(-r1 // bo)), np.arange(c0 // bi, -(-c1 // bi)))),
          self.fp8_block)
      return _take(block, [rows - r0, cols - c0])
    return self.read_index(weight, (rows, cols)).astype(np.float32)

  def linear(self, module: str) -> np.ndarray:
    """The float32 [O, I] weight of the Linear `module` (e.g. 'model.layers.0.mlp.up_proj'),
    dequantised when it is stored as block FP8 or packed INT4."""
    if f"{module}.weight_packed" in self:
      shape = tuple(int(v) for v in self.read(f"{module}.weight_shape"))
      return dequantize_int4(self.read(f"{module}.weight_packed"),
                             self.read(f"{module}.weight_scale"), shape, self.int4_group)
    weight = self.read(f"{module}.weight")
    if weight.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
      if f"{module}.weight_scale_inv" not in self:
        raise CheckpointError(f"{module}.weight is FP8 but {module}.weight_scale_inv is missing")
      return dequantize_fp8_block(weight, self.read(f"{module}.weight_scale_inv"), self.fp8_block)
    return weight.astype(np.float32)


def _take(array: np.ndarray, index: list[np.ndarray]) -> np.ndarray:
  """array[np.ix_(*index)], with contiguous index runs as slices (views, no gather copy)."""
  as_slices = tuple(slice(int(i[0]), int(i[-1]) + 1) if i.size and i[-1] - i[0] + 1 == i.size
                    else None for i in index)
  if all(s is not None for s in as_slices):
    return array[as_slices]
  return array[np.ix_(*index)]


def _refuse_partial(hf_dir: str, index_path: str, single: str) -> None:
  """A directory an exporter is still writing (or died writing) is never read as a checkpoint."""
  if os.path.exists(index_path) or os.path.exists(single) or not os.path.isdir(hf_dir):
    return
  temporary = [n for n in os.listdir(hf_dir) if n.endswith(".tmp")]
  if temporary or ".tmp-" in os.path.basename(os.path.normpath(hf_dir)):
    raise CheckpointError(f"{hf_dir}: a half-written export (temporary shards such as "
                          f"{sorted(temporary)[:2]}, no {INDEX_FILE}); it was interrupted or is "
                          "still being written. Export again; complete exports are renamed into "
                          "place only when every shard and the index are written")


def dequantize_fp8_block(weight: np.ndarray, scale_inv: np.ndarray,
                         block: tuple[int, int] = (128, 128)) -> np.ndarray:
  """weight fp8 [O, I], scale_inv [ceil(O/bo), ceil(I/bi)] -> float32 [O, I]."""
  o, i = weight.shape
  bo, bi = block
  expected = (-(-o // bo), -(-i // bi))
  if scale_inv.shape != expected:
    raise CheckpointError(f"FP8 weight {weight.shape} needs weight_scale_inv {expected} for "
                          f"{bo}x{bi} blocks, got {scale_inv.shape}")
  scale = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)[:o, :i]
  return weight.astype(np.float32) * scale


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int],
                    group_size: int = 32) -> np.ndarray:
  """packed int32 [O, ceil(I/8)], scale [O, ceil(I/group)] -> float32 [O, I] (shape = (O, I))."""
  o, i = shape
  if packed.shape != (o, -(-i // 8)) or scale.shape != (o, -(-i // group_size)):
    raise CheckpointError(
        f"INT4 weight of shape {shape} needs weight_packed {(o, -(-i // 8))} and weight_scale "
        f"{(o, -(-i // group_size))} (group {group_size}), got {packed.shape} and {scale.shape}")
  shifts = np.arange(8, dtype=np.uint32) * 4
  nibbles = (packed.view(np.uint32)[..., None] >> shifts) & 0xF  # [O, I/8, 8], lowest first
  values = nibbles.reshape(o, -1)[:, :i].astype(np.float32) - 8.0  # [O, I]
  groups = np.repeat(scale.astype(np.float32), group_size, axis=1)[:, :i]  # [O, I]
  return values * groups


def quantize_int4(w: np.ndarray, group_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
  """float32 [O, I] -> (packed int32 [O, I/8], scale bf16 [O, I/group]): symmetric INT4 per group,
  the inverse of `dequantize_int4`. The scale is the smallest one that fits the group's range
  into [-8, 7] (max(max/7, -min/8), rounded to bf16), so weights already on an INT4 grid (every
  group holding a -8 or a 7, as a fresh quantisation does) come back exactly."""
  o, i = w.shape
  if i % group_size or group_size % 8:
    raise CheckpointError(f"INT4 export needs in-features {i} divisible by group {group_size}")
  groups = w.astype(np.float32).reshape(o, i // group_size, group_size)
  scale = np.maximum(groups.max(-1) / 7, -groups.min(-1) / 8).astype(ml_dtypes.bfloat16)
  full = scale.astype(np.float32)[..., None]  # [O, I/g, 1]
  q = np.clip(np.round(np.divide(groups, full, out=np.zeros_like(groups), where=full > 0)), -8, 7)
  nibbles = (q.reshape(o, i // 8, 8) + 8).astype(np.uint32)
  packed = np.bitwise_or.reduce(nibbles << (np.arange(8, dtype=np.uint32) * 4), axis=-1)
  return packed.view(np.int32), scale


# Kimi-K2.5's quantization_config (../shared/research/kimi_config.md): only routed experts are INT4.
INT4_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                    "group_size": 32, "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
                    "strategy": "group", "symmetric": True, "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*eh_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


class ShardedWriter:
  """Writes tensors into safetensors shards of at most `max_shard_bytes`, plus the HF index.

  Each tensor goes to disk as it is added (a data file per shard); when a shard is full its
  header is written and the data streamed behind it, so host memory holds one tensor, not a
  shard. Files stay `*.tmp` until `close`, which names them and writes the index last."""

  def __init__(self, out_dir: str, max_shard_bytes: int = 5 << 30):
    self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
    self._pending: list[tuple[str, str, tuple[int, ...]]] = []  # (name, dtype name, shape)
    self._pending_bytes = 0
    self._data = None  # the open data file of the current shard
    self._shards: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
    self.total_bytes = 0
    os.makedirs(out_dir, exist_ok=True)

  def add(self, name: str, array: np.ndarray) -> None:
    array = np.ascontiguousarray(array)
    if array.dtype not in _NAMES:
      raise CheckpointError(f"cannot write {name}: dtype {array.dtype} has no safetensors name")
    if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
      self._flush()
    if self._data is None:
      self._data = open(os.path.join(self.out_dir, f"data-{len(self._shards):05d}.tmp"), "wb")
    self._data.write(memoryview(array.reshape(-1).view(np.uint8)))
    self._pending.append((name, _NAMES[array.dtype], array.shape))
    self._pending_bytes += array.nbytes
    self.total_bytes += array.nbytes

  def _flush(self) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in self._pending:
      nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
      header[name] = {"dtype": dtype, "shape": list(shape),
                      "data_offsets": [offset, offset + nbytes]}
      offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    tmp = f"shard-{len(self._shards):05d}.tmp"
    data_path = None
    if self._data is not None:
      data_path = self._data.name
      self._data.close()
      self._data = None
    with open(os.path.join(self.out_dir, tmp), "wb") as f:
      f.write(struct.pack("<Q", len(blob)))
      f.write(blob)
      if data_path is not None:
        with open(data_path, "rb") as data:
          shutil.copyfileobj(data, f, 16 << 20)
    if data_path is not None:
      os.remove(data_path)
    self._shards.append((tmp, [name for name, _, _ in self._pending]))
    self._pending, self._pending_bytes = [], 0

  def close(self) -> dict:
    """Flushes, renames shards to model-0000k-of-0000n.safetensors, writes the index."""
    if self._pending or not self._shards:
      self._flush()
    n, weight_map = len(self._shards), {}
    for k, (tmp, names) in enumerate(self._shards, start=1):
      final = f"model-{k:05d}-of-{n:05d}.safetensors"
      os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, final))
      weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
    with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
    return index

