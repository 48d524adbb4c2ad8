"""Weight publication for the asynchronous RL learner: every policy version, as snapshots + deltas.

    store = WeightStore(workdir + "/weights", snapshot_every=8, dtype="bfloat16")
    publisher = AsyncPublisher(store)
    for version in ...:
      state, metrics = train_step(state, batch)       # donates state
      publisher.publish(version, state.params)        # returns at once
    publisher.close()
    # engine process, same filesystem:
    params = WeightStore(workdir + "/weights").load(version)

Leaves are converted to the store dtype (floats only; integer and bool leaves are kept) and compared
as raw bit patterns. In bf16 most elements do not change between two optimizer steps (the
Composer 2 report measures >98% bit-identical), so a version is written as a delta against the
previous one: per leaf, the gaps between the sorted flat indices of changed elements (uint32, small
numbers that compress well) and their new bit patterns. Every `snapshot_every`-th publish is a full
snapshot, which bounds how many deltas a rebuild applies. Files are zlib-compressed npz, written
to a temporary name and renamed; `manifest.json` is replaced after the file, so readers never see
a record whose file is incomplete. Each record keeps the sha256 of its file and of the rebuilt
version's content (see `content_sha256`); `load` checks both and raises `CorruptWeightsError`.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import queue
import threading
import zlib
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

MANIFEST = "manifest.json"
_STORE_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
# Level 1: most of a snapshot is incompressible mantissa bits; higher levels cost time for ~nothing.
_ZLIB_LEVEL = 1


class CorruptWeightsError(RuntimeError):
  """A published file, or a version rebuilt from files, does not match its recorded checksum."""


@dataclasses.dataclass(frozen=True)
class PublishRecord:
  version: int
  kind: str                   # "snapshot" | "delta"
  base: Optional[int]         # version the delta applies to; None for snapshots
  file: str                   # name inside the store directory
  nbytes: int                 # bytes on disk
  changed: int                # elements written (all of them for a snapshot)
  total: int                  # elements in the version
  file_sha256: str
  content_sha256: str


def _bits(x: np.ndarray) -> np.ndarray:
  """The same memory as unsigned integers, so equality is bit equality (NaNs, -0.0 included)."""
  return np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")


def content_sha256(leaves: Mapping[str, np.ndarray]) -> str:
  """sha256 over the leaves in sorted-path order: path, dtype, shape, raw bytes."""
  h = hashlib.sha256()
  for path in sorted(leaves):
    x = np.ascontiguousarray(leaves[path])
    h.update(f"{path}\0{x.dtype.name}\0{x.shape}\0".encode())
    h.update(_bits(x).data)
  return h.hexdigest()


def _encode(arrays: dict[str, np.ndarray], meta: dict) -> bytes:
  buf = io.BytesIO()
  np.savez(buf, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
  return zlib.compress(buf.getvalue(), _ZLIB_LEVEL)


def _decode(raw: bytes) -> tuple[dict[str, np.ndarray], dict]:
  with np.load(io.BytesIO(zlib.decompress(raw)), allow_pickle=False) as npz:
    arrays = {key: npz[key] for key in npz.files}
  return arrays, json.loads(arrays.pop("__meta__").tobytes())


def write_atomic(path: str, data: bytes) -> None:
  """Writes `data` to `path` so that readers see the old file or the whole new one."""
  tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


class WeightStore:
  """A directory of published versions; reopening an existing directory continues its chain.

  `dtype` and `snapshot_every` default to the manifest's values (else "bfloat16" and 8), so an
  engine process opens the store with `WeightStore(directory)` whatever the learner chose.
  """

  def __init__(self, directory: str, *, snapshot_every: Optional[int] = None,
               dtype: Optional[str] = None):
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    self._lock = threading.RLock()
    self._records: list[PublishRecord] = []
    self._published_count = 0
    self._last_version: Optional[int] = None
    # (version, {path: array in store dtype}) of the last version published or rebuilt: the base
    # of the next delta, and the start of the next rebuild when versions are read in order.
    self._cache: Optional[tuple[int, dict[str, np.ndarray]]] = None
    stored = self._refresh()
    dtype = dtype or (stored or {}).get("dtype", "bfloat16")
    if dtype not in _STORE_DTYPES:
      raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_STORE_DTYPES)}")
    if stored and stored["dtype"] != dtype:
      raise ValueError(f"{self.directory} holds {stored['dtype']} weights, not {dtype}")
    self.dtype_name = dtype
    self.dtype = _STORE_DTYPES[dtype]
    self.snapshot_every = snapshot_every or (stored or {}).get("snapshot_every", 8)
    if self.snapshot_every < 1:
      raise ValueError(f"snapshot_every={self.snapshot_every} must be >= 1")

  def _refresh(self) -> Optional[dict]:
    """Rereads the manifest: the learner, in another process, may have published or pruned."""
    try:
      with open(os.path.join(self.directory, MANIFEST)) as f:
        manifest = json.load(f)
    except FileNotFoundError:
      return None
    self._records = [PublishRecord(**r) for r in manifest["records"]]
    self._published_count = manifest["published_count"]
    self._last_version = manifest["last_version"]
    return manifest

  def _write_manifest(self) -> None:
    manifest = {"dtype": self.dtype_name, "snapshot_every": self.snapshot_every,
                "published_count": self._published_count, "last_version": self._last_version,
                "records": [dataclasses.asdict(r) for r in self._records]}
    write_atomic(os.path.join(self.directory, MANIFEST), json.dumps(manifest).encode())

  def records(self) -> list[PublishRecord]:
    with self._lock:
      self._refresh()
      return list(self._records)

  def versions(self) -> list[int]:
    return [r.version for r in self.records()]

  def latest_version(self) -> Optional[int]:
    versions = self.versions()
    return versions[-1] if versions else None

  def _convert(self, params: Any) -> dict[str, np.ndarray]:
    leaves = {}
    for path, leaf in traverse_util.flatten_dict(jax.device_get(params), sep="/").items():
      x = np.asarray(leaf)
      if x.dtype.kind not in "iub" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"leaf {path!r}: cannot publish dtype {x.dtype}")
      x = x.astype(self.dtype if x.dtype.kind not in "iub" else x.dtype, order="C")
      # Always a private copy: it is the next delta's base, and the caller may reuse its arrays.
      x.flags.writeable = False
      leaves[path] = x
    return leaves

  def publish(self, version: int, params: Any) -> PublishRecord:
    """Writes `params` (nested dicts of numpy/jax arrays) as `version`, a snapshot or a delta."""
    version = int(version)
    with self._lock:
      self._refresh()
      if self._last_version is not None and version <= self._last_version:
        raise ValueError(f"version {version} must be greater than the last published version "
                         f"{self._last_version} in {self.directory}")
      leaves = self._convert(params)
      base = self._delta_base(leaves)
      total = sum(x.size for x in leaves.values())
      if base is None:
        arrays = {f"s{i}": _bits(x) for i, x in enumerate(leaves.values())}
        kind, changed = "snapshot", total
      else:
        kind, changed, arrays = "delta", 0, {}
        for i, (path, x) in enumerate(leaves.items()):
          new, old = _bits(x).ravel(), _bits(base[path]).ravel()
          index = np.flatnonzero(new != old)
          gap_dtype = np.uint32 if x.size < 2**32 else np.uint64
          arrays[f"g{i}"] = np.diff(index, prepend=0).astype(gap_dtype)
          arrays[f"v{i}"] = new[index]
          changed += index.size
      meta = {"paths": list(leaves), "dtypes": [x.dtype.name for x in leaves.values()],
              "shapes": [list(x.shape) for x in leaves.values()]}
      data = _encode(arrays, meta)
      name = f"{version:010d}.{kind}.npz.z"
      write_atomic(os.path.join(self.directory, name), data)
      record = PublishRecord(version=version, kind=kind,
                             base=None if base is None else self._records[-1].version,
                             file=name, nbytes=len(data), changed=int(changed), total=int(total),
                             file_sha256=hashlib.sha256(data).hexdigest(),
                             content_sha256=content_sha256(leaves))
      self._records.append(record)
      self._published_count += 1
      self._last_version = version
      self._write_manifest()
      self._cache = (version, leaves)
      return record

  def _delta_base(self, leaves: dict[str, np.ndarray]) -> Optional[dict[str, np.ndarray]]:
    """The previous version's leaves when this publish may be a delta, else None (snapshot)."""
    if not self._records or self._published_count % self.snapshot_every == 0:
      return None
    previous = self._records[-1].version
    base = self._cache[1] if self._cache and self._cache[0] == previous else None
    if base is None:  # reopened store: rebuild the previous version once
      try:
        base = self._rebuild(previous)
      except (CorruptWeightsError, OSError):
        return None  # the learner holds the true params: a snapshot restarts a sound chain
    same_layout = list(base) == list(leaves) and all(
        base[p].shape == x.shape and base[p].dtype == x.dtype for p, x in leaves.items())
    return base if same_layout else None

  def _read(self, record: PublishRecord) -> tuple[dict[str, np.ndarray], dict]:
    path = os.path.join(self.directory, record.file)
    with open(path, "rb") as f:
      raw = f.read()
    if hashlib.sha256(raw).hexdigest() != record.file_sha256:
      raise CorruptWeightsError(f"{path}: checksum mismatch in the file of version "
                                f"{record.version}")
    return _decode(raw)

  def _rebuild(self, version: int) -> dict[str, np.ndarray]:
    by_version = {r.version: r for r in self._records}
    if version not in by_version:
      raise KeyError(f"version {version} is not in {self.directory} (have {sorted(by_version)})")
    chain = [by_version[version]]  # target back to its snapshot, or to the cached version
    while chain[-1].kind == "delta" and not (self._cache and self._cache[0] == chain[-1].version):
      chain.append(by_version[chain[-1].base])
    leaves = None
    for record in reversed(chain):
      if self._cache and self._cache[0] == record.version:
        leaves = self._cache[1]
        continue
      arrays, meta = self._read(record)
      layout = zip(meta["paths"], meta["dtypes"], meta["shapes"])
      if record.kind == "snapshot":
        leaves = {p: arrays[f"s{i}"].view(d).reshape(s) for i, (p, d, s) in enumerate(layout)}
        continue
      updated = {}
      for i, (path, dtype, shape) in enumerate(layout):
        gaps, values = arrays[f"g{i}"], arrays[f"v{i}"]
        if gaps.size == 0:  # unchanged leaf: shared with the base, never written to
          updated[path] = leaves[path]
          continue
        flat = _bits(leaves[path]).ravel().copy()
        flat[np.cumsum(gaps, dtype=np.int64)] = values
        updated[path] = flat.view(dtype).reshape(shape)
      leaves = updated
    for x in leaves.values():
      x.flags.writeable = False
    target = by_version[version]
    if content_sha256(leaves) != target.content_sha256:
      raise CorruptWeightsError(f"{os.path.join(self.directory, target.file)}: version {version} "
                                "rebuilt with the wrong content checksum")
    self._cache = (version, leaves)
    return leaves

  def load(self, version: int) -> dict:
    """Nested dicts of read-only numpy arrays in the store dtype (shared with the store's cache)."""
    with self._lock:
      self._refresh()
      return traverse_util.unflatten_dict(self._rebuild(int(version)), sep="/")

  def prune(self, keep_from_version: int) -> list[str]:
    """Deletes the files not needed to rebuild versions >= keep_from_version; returns their names.

    The latest version always stays loadable: the next delta is written against it.
    """
    with self._lock:
      self._refresh()
      if not self._records:
        return []
      first_kept = next((i for i, r in enumerate(self._records)
                         if r.version >= keep_from_version), len(self._records) - 1)
      # Each delta's base is the record before it, so the kept chain starts at a snapshot.
      while self._records[first_kept].kind != "snapshot":
        first_kept -= 1
      dropped, self._records = self._records[:first_kept], self._records[first_kept:]
      if not dropped:
        return []
      return self._forget(dropped)

  def truncate_after(self, version: int) -> list[str]:
    """Forgets the versions after `version` (a resumed learner restarts from its checkpoint's
    step and publishes those versions again, with new weights); returns the files deleted."""
    with self._lock:
      self._refresh()
      kept = [r for r in self._records if r.version <= version]
      dropped = self._records[len(kept):]
      if not dropped:
        return []
      self._records = kept
      self._last_version = kept[-1].version if kept else None
      self._published_count -= len(dropped)
      self._cache = None
      return self._forget(dropped)

  def _forget(self, dropped: list[PublishRecord]) -> list[str]:
    """Writes the manifest without `dropped`, then deletes their files; returns their names."""
    self._write_manifest()  # first: a crash must not leave records whose files are gone
    for record in dropped:
      try:
        os.remove(os.path.join(self.directory, record.file))
      except FileNotFoundError:
        pass
    return [r.file for r in dropped]

  def delta_stats(self) -> dict[str, float]:
    """Delta vs snapshot size over the records on disk: the figure reported for a real run."""
    records = self.records()
    deltas = [r for r in records if r.kind == "delta"]
    snapshots = [r for r in records if r.kind == "snapshot"]
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
    delta_bytes = mean([r.nbytes for r in deltas])
    snapshot_bytes = mean([r.nbytes for r in snapshots])
    return {"num_deltas": len(deltas), "num_snapshots": len(snapshots),
            "delta_bytes_mean": delta_bytes, "snapshot_bytes_mean": snapshot_bytes,
            "delta_to_snapshot_ratio": delta_bytes / snapshot_bytes,
            "identical_fraction_mean": mean([1.0 - r.changed / max(r.total, 1) for r in deltas])}


def _device_copy(x: Any, dtype: np.dtype) -> jax.Array:
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
    return x.astype(dtype)  # a new buffer too, so safe from donation
  return jnp.copy(x)


class AsyncPublisher:
  """Publishes from one background thread so the training step never waits for disk.

  `publish` takes a device-side copy at once: the train step donates its state, so the arrays
  passed in are deleted by the next step. The copy is cast to the store dtype on device, which
  halves its memory and the device->host transfer for bf16 stores.
  """

  def __init__(self, store: WeightStore, *, max_queued: int = 2):
    self.store = store
    # Bounded: each queued version holds a device copy of the params. If the writer falls behind,
    # `publish` blocks until the oldest queued version is written instead of growing memory.
    self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
    self._error: Optional[BaseException] = None
    self._latest_published = store.latest_version()
    self._last_queued = self._latest_published
    self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
    self._thread.start()

  @property
  def latest_published(self) -> Optional[int]:
    return self._latest_published

  def _raise_pending_error(self) -> None:
    error, self._error = self._error, None
    if error is not None:
      raise RuntimeError(f"weight publication to {self.store.directory} failed") from error

  def publish(self, version: int, params: Any) -> None:
    self._raise_pending_error()
    if self._last_queued is not None and version <= self._last_queued:
      raise ValueError(f"version {version} must be greater than the last published version "
                       f"{self._last_queued}")
    self._queue.put((int(version), jax.tree.map(
        functools.partial(_device_copy, dtype=self.store.dtype), params)))
    self._last_queued = version

  def _run(self) -> None:
    while True:
      item = self._queue.get()
      try:
        if item is None:
          return
        version, params = item
        if self._error is None:  # after a failure, drop versions until the caller has seen it
          self.store.publish(version, jax.device_get(params))
          self._latest_published = version
      except BaseException as e:  # noqa: BLE001 - handed to the training thread
        self._error = e
      finally:
        item = params = None
        self._queue.task_done()

  def wait(self) -> None:
    """Blocks until every queued version is written; re-raises a writer error."""
    self._queue.join()
    self._raise_pending_error()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._queue.put(None)
      self._thread.join()
