"""Random-access record sources: JSONL, Parquet, ArrayRecord and the embedded stdlib corpus.

Every source is a grain `RandomAccessDataSource` of records (plain dicts), so the pipeline can
shuffle globally and shard by index (c2/data/pipeline.py). Record schemas:
  * JSONL: one JSON object per non-blank line.
  * Parquet: one row = one record, columns as keys; JSON-string cells stay strings (the
    consumers in c2/data/examples.py parse a "messages"/"tools" string if they find one).
  * ArrayRecord: each record is the UTF-8 JSON of an object, i.e. a JSONL line.
  * stdlib: {"text": file source}.
  * stdlib_chat: {"messages": [...]} (+ "tools") coding tasks built from the stdlib for SFT
    (c2/data/stdlib_chat.py).
  * copy_drills: {"drill": index} records of copy drills over the tool-call tokens of the given
    transcripts (c2/data/copy_drills.py; language modelling only).

A source spec is a short string:
  "stdlib"                                      the embedded corpus (split = train / heldout)
  "stdlib_chat"                                 its embedded SFT chats (same split)
  "jsonl:/data/{split}-*.jsonl"                 kind prefix, optional `{split}` placeholder, globs
  "gs://bucket/corpus/{split}.parquet"          kind inferred from the extension
  "arrayrecord:/data/a.array_record,/data/b.array_record"   comma-separated paths
  "copy_drills:runs/agentic-data/train-*.jsonl" drills over those transcripts' tool-call tokens
Without `{split}` the same files serve every split, so give evaluation its own spec.
Paths go through etils.epath, so `gs://` works wherever epath has a GCS backend (gcsfs or TF).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any, Sequence

from etils import epath
import grain
import numpy as np

from c2.data import copy_drills, stdlib_chat, stdlib_corpus

KINDS = ("stdlib", "stdlib_chat", "jsonl", "parquet", "arrayrecord", "copy_drills")
_EMBEDDED_KINDS = ("stdlib", "stdlib_chat")  # built in, no paths
_EXTENSION_KIND = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet",
                   ".array_record": "arrayrecord", ".arrayrecord": "arrayrecord"}
_GLOB_CHARS = frozenset("*?[")


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  """Which records to read: a kind and path patterns (which may contain `{split}` and globs)."""

  kind: str
  patterns: tuple[str, ...] = ()

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"source kind must be one of {KINDS}, got {self.kind!r}")
    if (self.kind in _EMBEDDED_KINDS) != (not self.patterns):
      raise ValueError(f"the embedded sources {_EMBEDDED_KINDS} take no paths; every other "
                       "source needs some")

  @classmethod
  def parse(cls, spec: str | SourceSpec) -> SourceSpec:
    if isinstance(spec, SourceSpec):
      return spec
    if spec in _EMBEDDED_KINDS:
      return cls(spec)
    kind, sep, rest = spec.partition(":")
    if sep and kind in KINDS:
      return cls(kind, tuple(p for p in rest.split(",") if p))
    # No kind prefix ("gs:" is a scheme, not a kind): infer the kind from the extension.
    patterns = tuple(p for p in spec.split(",") if p)
    kinds = {_EXTENSION_KIND.get(epath.Path(p.replace("*", "x")).suffix) for p in patterns}
    if len(kinds) != 1 or None in kinds:
      raise ValueError(f"cannot infer one source kind from {spec!r}; prefix it with one of {KINDS}")
    return cls(kinds.pop(), patterns)

  def resolve_paths(self, split: str) -> list[epath.Path]:
    """Concrete files for a split, in sorted order within each pattern (deterministic)."""
    paths = []
    for pattern in self.patterns:
      matches = _expand(pattern.replace("{split}", split))
      if not matches:
        raise FileNotFoundError(f"no files match {pattern!r} for split {split!r}")
      paths.extend(matches)
    return paths


def _expand(pattern: str) -> list[epath.Path]:
  if not _GLOB_CHARS.intersection(pattern):
    return [epath.Path(pattern)] if epath.Path(pattern).exists() else []
  # epath globs relative to a directory, so split at the first component holding a wildcard.
  parts = pattern.split("/")
  first_glob = next(i for i, part in enumerate(parts) if _GLOB_CHARS.intersection(part))
  base = epath.Path("/".join(parts[:first_glob]) or ".")
  return sorted(base.glob("/".join(parts[first_glob:])), key=str)


class JsonlSource:
  """JSON lines, indexed by byte offset once at start-up so any record is one seek away."""

  def __init__(self, paths: Sequence[epath.Path]):
    self._paths = [str(p) for p in paths]
    offsets, counts = [], []
    for path in paths:
      starts, position = [], 0
      with epath.Path(path).open("rb") as f:
        for line in f:
          if line.strip():
            starts.append(position)
          position += len(line)
      offsets.append(np.asarray(starts, np.int64))
      counts.append(len(starts))
    self._offsets = offsets
    self._first_index = np.cumsum([0] + counts)  # record index where each file starts
    self._lock = threading.Lock()
    self._handles: dict[int, Any] = {}

  def __len__(self) -> int:
    return int(self._first_index[-1])

  def __getitem__(self, index: int) -> dict:
    file_index = int(np.searchsorted(self._first_index, index, side="right")) - 1
    offset = int(self._offsets[file_index][index - self._first_index[file_index]])
    # grain reads with several threads; one shared handle per file needs seek+read to be atomic.
    with self._lock:
      handle = self._handles.get(file_index)
      if handle is None:
        handle = self._handles[file_index] = epath.Path(self._paths[file_index]).open("rb")
      handle.seek(offset)
      line = handle.readline()
    return json.loads(line)

  def __getstate__(self):  # open handles and locks do not pickle (grain worker processes)
    state = dict(self.__dict__, _handles={})
    del state["_lock"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state, _lock=threading.Lock())


class ParquetSource:
  """Parquet rows; reads whole row groups (Parquet's unit of decoding) through a small LRU cache.

  Global shuffling touches a random row group per record, so this suits modest Parquet corpora; for
  large corpora convert to ArrayRecord, whose records are individually addressable.
  """

  _CACHED_ROW_GROUPS = 4

  def __init__(self, paths: Sequence[epath.Path]):
    import pyarrow.parquet as pq  # optional dependency, only needed for Parquet sources
    self._paths = [str(p) for p in paths]
    self._groups = []  # (file index, row group index), in file order
    group_rows = []
    for file_index, path in enumerate(paths):
      with epath.Path(path).open("rb") as f:
        metadata = pq.ParquetFile(f).metadata
      for group in range(metadata.num_row_groups):
        self._groups.append((file_index, group))
        group_rows.append(metadata.row_group(group).num_rows)
    self._first_index = np.cumsum([0] + group_rows)
    self._lock = threading.Lock()
    self._cache: collections.OrderedDict = collections.OrderedDict()

  def __len__(self) -> int:
    return int(self._first_index[-1])

  def _rows_of_group(self, group_index: int) -> list[dict]:
    import pyarrow.parquet as pq
    with self._lock:
      if group_index in self._cache:
        self._cache.move_to_end(group_index)
        return self._cache[group_index]
      file_index, group = self._groups[group_index]
      with epath.Path(self._paths[file_index]).open("rb") as f:
        rows = pq.ParquetFile(f).read_row_group(group).to_pylist()
      self._cache[group_index] = rows
      if len(self._cache) > self._CACHED_ROW_GROUPS:
        self._cache.popitem(last=False)
      return rows

  def __getitem__(self, index: int) -> dict:
    group_index = int(np.searchsorted(self._first_index, index, side="right")) - 1
    return self._rows_of_group(group_index)[index - int(self._first_index[group_index])]

  def __getstate__(self):
    state = dict(self.__dict__, _cache=collections.OrderedDict())
    del state["_lock"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state, _lock=threading.Lock())


class ArrayRecordSource:
  """ArrayRecord files whose records are JSON objects (the bytes of a JSONL line)."""

  def __init__(self, paths: Sequence[epath.Path]):
    self._records = grain.sources.ArrayRecordDataSource([str(p) for p in paths])

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> dict:
    return json.loads(self._records[index])


class StdlibSource:
  """The embedded stdlib corpus as {"text": ...} records; files are read on demand."""

  def __init__(self, split: str):
    self._paths = stdlib_corpus.stdlib_files(split)

  def __len__(self) -> int:
    return len(self._paths)

  def __getitem__(self, index: int) -> dict:
    return {"text": stdlib_corpus.read_source(self._paths[index])}


def open_source(spec: str | SourceSpec, split: str):
  """A random-access source of record dicts for one split."""
  spec = SourceSpec.parse(spec)
  if spec.kind == "stdlib":
    return StdlibSource(split)
  if spec.kind == "stdlib_chat":
    return stdlib_chat.StdlibChatSource(split)
  if spec.kind == "copy_drills":  # the alphabet's transcripts are read by the drill transform
    return copy_drills.DrillIndexSource(split)
  paths = spec.resolve_paths(split)
  source_class = {"jsonl": JsonlSource, "parquet": ParquetSource,
                  "arrayrecord": ArrayRecordSource}[spec.kind]
  return source_class(paths)
