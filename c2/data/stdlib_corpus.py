"""The embedded default corpus: the running interpreter's standard-library Python source.

Real code, always present, no download. Files are split deterministically into `train` and
`heldout` by a hash of their path relative to the stdlib root, so the split does not depend on the
machine or the order in which the filesystem lists files. About 2% of files are held out.

The corpus depends on the Python version (3.11's stdlib differs from 3.12's); the tokenizer
trained on it is therefore cached in the workdir so that a resumed run keeps its vocabulary.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import sysconfig
from typing import Iterator

SPLITS = ("train", "heldout")
HELDOUT_PER_MILLE = 20
# Test suites are excluded by default: they carry deliberately odd encodings and data blobs
# rather than representative code.
_ALWAYS_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
  """`heldout` for ~2% of paths, chosen by a stable hash (not Python's salted `hash`)."""
  digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
  bucket = int.from_bytes(digest[:8], "little") % 1000
  return "heldout" if bucket < HELDOUT_PER_MILLE else "train"


def hash_order_key(relative_path: str) -> bytes:
  """A stable, content-independent order that mixes packages (used to pick training subsets)."""
  return hashlib.sha256(b"order:" + relative_path.encode("utf-8")).digest()


def stdlib_files(split: str, *, include_tests: bool = False) -> list[pathlib.Path]:
  """Non-empty `.py` files of the given split, sorted by relative path (deterministic)."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  root = stdlib_root()
  excluded = _ALWAYS_EXCLUDED_DIRS | (frozenset() if include_tests else _TEST_DIRS)
  files = []
  for directory, subdirs, names in os.walk(root):
    # Pruning in place keeps the walk out of site-packages, which can dwarf the stdlib.
    subdirs[:] = [d for d in subdirs if d not in excluded]
    for name in names:
      path = pathlib.Path(directory, name)
      if (name.endswith(".py") and path.is_file() and path.stat().st_size > 0
          and split_of(path.relative_to(root).as_posix()) == split):
        files.append(path)
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_source(path: pathlib.Path) -> str:
  # A handful of stdlib files are not valid UTF-8; replacing keeps every file usable.
  return path.read_text(encoding="utf-8", errors="replace")


def stdlib_corpus(split: str, *, include_tests: bool = False) -> Iterator[str]:
  """Yields the text of each file of the split, in sorted-path order."""
  for path in stdlib_files(split, include_tests=include_tests):
    yield read_source(path)


def training_subset(max_bytes: int) -> Iterator[str]:
  """Train-split files in hash order until about `max_bytes` of source has been yielded.

  Hash order (rather than alphabetical) spreads a small budget over the whole stdlib instead of
  spending it on the first few packages.
  """
  root = stdlib_root()
  files = sorted(stdlib_files("train"), key=lambda p: hash_order_key(p.relative_to(root).as_posix()))
  total = 0
  for path in files:
    if total >= max_bytes:
      return
    text = read_source(path)
    total += len(text.encode("utf-8"))
    yield text
