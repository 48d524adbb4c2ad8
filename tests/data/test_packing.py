"""Packing: exact segment_ids / positions / loss_mask values, and lossless cutting of long examples."""
import grain
from hypothesis import given, settings, strategies as st
import numpy as np

from c2.data import examples as examples_lib
from c2.data import packing

PAD = 99


def example(tokens, mask=None):
  mask = [1] * len(tokens) if mask is None else mask
  return {"tokens": np.asarray(tokens, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def pack(examples, *, seq_len, batch_size, bins=4):
  dataset = grain.MapDataset.source(examples).to_iter_dataset()
  rows = packing.pack_examples(dataset, seq_len=seq_len, pad_id=PAD, num_packing_bins=bins, seed=0)
  return list(packing.batch_rows(rows, batch_size))


def segments_of(batch):
  """(tokens, loss_mask, positions) of every packed segment, plus the padding cells."""
  segments, padding = [], []
  for row in range(batch["tokens"].shape[0]):
    ids = batch["segment_ids"][row]
    for segment in np.unique(ids[ids > 0]):
      where = ids == segment
      assert np.all(np.diff(np.flatnonzero(where)) == 1), "a segment must be contiguous"
      segments.append((batch["tokens"][row][where].tolist(), batch["loss_mask"][row][where].tolist(),
                       batch["positions"][row][where].tolist()))
    padding.append({k: batch[k][row][ids == 0] for k in packing.BATCH_KEYS})
  return segments, padding


def test_batch_contract_dtypes_and_shapes():
  (batch,) = pack([example([1, 2, 3]), example([4, 5])], seq_len=8, batch_size=1, bins=1)
  assert set(batch) == set(packing.BATCH_KEYS)
  for key, dtype in [("tokens", np.int32), ("segment_ids", np.int32), ("positions", np.int32),
                     ("loss_mask", np.float32)]:
    assert batch[key].shape == (1, 8) and batch[key].dtype == dtype


def test_packed_values_exactly():
  (batch,) = pack([example([1, 2, 3]), example([4, 5], mask=[1, 0])], seq_len=8, batch_size=1,
                  bins=1)
  np.testing.assert_array_equal(batch["tokens"], [[1, 2, 3, 4, 5, PAD, PAD, PAD]])
  np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 2, 2, 0, 0, 0]])
  np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 0, 1, 0, 0, 0]])
  # First token of each segment is never a target; the SFT mask zero carries through.
  np.testing.assert_array_equal(batch["loss_mask"], [[0, 1, 1, 0, 0, 0, 0, 0]])


def test_every_example_packed_once_with_its_own_positions_and_mask():
  rng = np.random.default_rng(0)
  examples = []
  for _ in range(40):
    length = int(rng.integers(1, 17))
    examples.append(example(rng.integers(0, 50, length), mask=rng.integers(0, 2, length)))
  # batch_size 1 never drops a remainder, so every example must come out exactly once.
  batches = pack(examples, seq_len=16, batch_size=1, bins=4)
  found = []
  for batch in batches:
    segments, padding = segments_of(batch)
    found.extend(segments)
    for cells in padding:
      assert np.all(cells["tokens"] == PAD) and not cells["positions"].any()
      assert not cells["loss_mask"].any()
  expected = []
  for e in examples:
    mask = e["loss_mask"].astype(np.float32)
    mask[0] = 0
    expected.append((e["tokens"].tolist(), mask.tolist(), list(range(len(e["tokens"])))))
  assert sorted(found) == sorted(expected)
  assert len(batches) < len(examples)  # rows really hold several examples


def cut(tokens, mask, max_length):
  return examples_lib.CutToLength(max_length).flat_map(example(tokens, mask))


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 60), max_length=st.integers(2, 12), seed=st.integers(0, 9))
def test_cutting_trains_every_transition_exactly_once(length, max_length, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 1000, length)
  mask = rng.integers(0, 2, length)
  pieces = cut(tokens, mask, max_length)
  trained = []  # (previous token index, target index) pairs as the step would weigh them
  offset = 0
  for piece in pieces:
    n = len(piece["tokens"])
    assert 1 <= n <= max_length and (n >= 2 or len(pieces) == 1)
    np.testing.assert_array_equal(piece["tokens"], tokens[offset:offset + n])
    np.testing.assert_array_equal(piece["loss_mask"], mask[offset:offset + n])
    # Within a piece, target t (t >= 1) is trained iff its mask is set (first token never).
    trained.extend(offset + t for t in range(1, n) if piece["loss_mask"][t])
    offset += n - 1
  assert offset == max(length - 1, 0)
  assert trained == [t for t in range(1, length) if mask[t]]


def test_fill_ratio():
  (batch,) = pack([example([1, 2, 3]), example([4, 5])], seq_len=8, batch_size=1, bins=1)
  assert packing.fill_ratio(batch) == 5 / 8
