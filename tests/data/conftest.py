"""Shared fixtures: a small default tokenizer (trained once per session) and record-file writers."""
import json
import pathlib

import pytest

from c2.data import default_tokenizer
from c2.data.tokenizer import HuggingFaceTokenizer

# Small enough to train fast on 2 cores, big enough for real merges (256 bytes + 23 specials).
SMALL_VOCAB_SIZE = 512
SMALL_TRAIN_BYTES = 600_000


@pytest.fixture(scope="session")
def small_tokenizer_path(tmp_path_factory):
  cache_dir = tmp_path_factory.mktemp("tokenizer_cache")
  return default_tokenizer.ensure_default_tokenizer(
      cache_dir, vocab_size=SMALL_VOCAB_SIZE, max_train_bytes=SMALL_TRAIN_BYTES)


@pytest.fixture(scope="session")
def small_tokenizer(small_tokenizer_path):
  return HuggingFaceTokenizer.from_file(small_tokenizer_path)


def write_records(directory, kind, records, name="part"):
  """Writes record dicts as a JSONL, Parquet or ArrayRecord file; returns its path."""
  suffix = {"jsonl": "jsonl", "parquet": "parquet", "arrayrecord": "array_record"}[kind]
  path = pathlib.Path(directory) / f"{name}.{suffix}"
  if kind == "jsonl":
    # A blank line in the middle must be skipped, as real files sometimes have one.
    lines = [json.dumps(r) for r in records]
    path.write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n")
  elif kind == "parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq
    # Small row groups so reads cross row-group boundaries.
    pq.write_table(pa.Table.from_pylist(list(records)), path, row_group_size=3)
  else:
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for record in records:
      writer.write(json.dumps(record).encode())
    writer.close()
  return path


@pytest.fixture
def record_writer():
  return write_records
