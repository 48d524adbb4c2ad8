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
import struct
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
    self.used.add(name)
    return np.frombuffer(buf, _DTYPES[info["dtype"]]).reshape(info["shape"])

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


class ShardedWriter:
  """Writes tensors into safetensors shards of at most `max_shard_bytes`, plus the HF index.

  Tensors are buffered until a shard is full, so host memory holds at most one shard."""

  def __init__(self, out_dir: str, max_shard_bytes: int = 5 << 30):
    self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
    self._pending: list[tuple[str, np.ndarray]] = []
    self._pending_bytes = 0
    self._shards: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
    self.total_bytes = 0
    os.makedirs(out_dir, exist_ok=True)

  def add(self, name: str, array: np.ndarray) -> None:
    array = np.ascontiguousarray(array)
    if array.dtype not in _NAMES:
      raise CheckpointError(f"cannot write {name}: dtype {array.dtype} has no safetensors name")
    if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
      self._flush()
    self._pending.append((name, array))
    self._pending_bytes += array.nbytes
    self.total_bytes += array.nbytes

  def _flush(self) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, array in self._pending:
      header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                      "data_offsets": [offset, offset + array.nbytes]}
      offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    tmp = f"shard-{len(self._shards):05d}.tmp"
    with open(os.path.join(self.out_dir, tmp), "wb") as f:
      f.write(struct.pack("<Q", len(blob)))
      f.write(blob)
      for _, array in self._pending:
        f.write(array.tobytes())  # one tensor's copy at a time
    self._shards.append((tmp, [name for name, _ in self._pending]))
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

