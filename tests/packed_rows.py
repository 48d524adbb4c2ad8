"""Segment ids and positions of packed rows, from each row's document lengths (test fixtures)."""
import numpy as np


def packed_rows(docs, length: int) -> tuple[np.ndarray, np.ndarray]:
  """docs: per row, its documents' lengths (what is left of the row is padding, segment 0)
  -> (segment_ids [rows, length] numbered from 1 per row, positions restarting at 0 per document)."""
  seg, pos = np.zeros((len(docs), length), np.int32), np.zeros((len(docs), length), np.int32)
  for b, lengths in enumerate(docs):
    start = 0
    for doc, n in enumerate(lengths, start=1):
      seg[b, start:start + n], pos[b, start:start + n] = doc, np.arange(n)
      start += n
  return seg, pos
