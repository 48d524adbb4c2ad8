"""Record sources: spec parsing, JSONL / Parquet / ArrayRecord / stdlib reads."""
import pickle

import pytest

from c2.data import sources, stdlib_corpus
from c2.data.sources import SourceSpec

RECORDS = [{"text": f"document number {i}", "id": i} for i in range(10)]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrayrecord"])
def test_each_source_reads_every_record(tmp_path, record_writer, kind):
  suffix = record_writer(tmp_path, kind, RECORDS[:6], name="train-0").suffix
  record_writer(tmp_path, kind, RECORDS[6:], name="train-1")
  source = sources.open_source(f"{kind}:{tmp_path}/{{split}}-*{suffix}", "train")
  assert len(source) == len(RECORDS)
  # Out-of-order access, as a global shuffle would do it.
  for index in [9, 0, 5, 6, 2, 8]:
    assert source[index]["text"] == RECORDS[index]["text"]
  # grain worker processes receive sources by pickling.
  assert pickle.loads(pickle.dumps(source))[7]["text"] == RECORDS[7]["text"]


def test_stdlib_source_reads_files():
  source = sources.open_source("stdlib", "heldout")
  files = stdlib_corpus.stdlib_files("heldout")
  assert len(source) == len(files)
  assert source[0]["text"] == files[0].read_text(encoding="utf-8", errors="replace")


@pytest.mark.parametrize("spec, kind, patterns", [
    ("stdlib", "stdlib", ()),
    ("jsonl:/data/{split}-*.jsonl", "jsonl", ("/data/{split}-*.jsonl",)),
    ("gs://bucket/corpus/{split}.parquet", "parquet", ("gs://bucket/corpus/{split}.parquet",)),
    ("/a/x.array_record,/a/y.array_record", "arrayrecord",
     ("/a/x.array_record", "/a/y.array_record")),
    ("parquet:gs://bucket/shards/*", "parquet", ("gs://bucket/shards/*",)),
])
def test_spec_parsing(spec, kind, patterns):
  assert SourceSpec.parse(spec) == SourceSpec(kind, patterns)


@pytest.mark.parametrize("spec", ["/data/corpus.txt", "/a/x.jsonl,/a/y.parquet", "jsonl"])
def test_spec_parsing_rejects_ambiguous(spec):
  with pytest.raises(ValueError):
    SourceSpec.parse(spec)


def test_missing_files_are_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="heldout"):
    sources.open_source(f"jsonl:{tmp_path}/{{split}}.jsonl", "heldout")
