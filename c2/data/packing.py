"""Packing examples into fixed-length rows and batching rows into the train step's batch.

Batch contract (what the train step relies on; per process, B = batch_size, T = seq_len):
  tokens       [B, T] int32    token ids; pad id where nothing was packed
  segment_ids  [B, T] int32    1, 2, ... per example packed into the row; 0 on padding
  positions    [B, T] int32    0, 1, ... within each segment; 0 on padding
  loss_mask    [B, T] float32  1 where the token at t is a valid target: inside a segment, not a
                               segment's first token, and (for SFT) an assistant token; else 0
Targets are NOT shifted here: the step predicts tokens[t+1] at t when segment_ids[t+1] ==
segment_ids[t] and weighs that prediction by loss_mask[t+1] (c2/losses/targets.py).

Packing is grain's first-fit packer: it fills `num_packing_bins` rows at a time, putting each
example into the first row with room, and emits all rows when an example fits nowhere. More bins
mean less padding but more examples from far apart in the (shuffled) order sharing a row.
"""
from __future__ import annotations

import grain
import numpy as np

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


def pack_examples(examples: grain.IterDataset, *, seq_len: int, pad_id: int,
                  num_packing_bins: int, seed: int) -> grain.IterDataset:
  """Rows of length seq_len from examples of length <= seq_len (cut longer ones first).

  Output rows carry grain's packing fields: tokens, tokens_segment_ids, tokens_positions,
  loss_mask (and loss_mask_segment_ids / _positions, identical and dropped later).
  """
  return grain.experimental.FirstFitPackIterDataset(
      examples,
      length_struct={"tokens": seq_len, "loss_mask": seq_len},
      padding_struct={"tokens": pad_id, "loss_mask": 0},
      num_packing_bins=num_packing_bins,
      seed=seed,  # shuffles the emitted rows among themselves
  )


class PackedRowsToBatch(grain.transforms.Map):
  """Renames grain's packing fields to the batch contract and finalises loss_mask."""

  def map(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    segment_ids = rows["tokens_segment_ids"].astype(np.int32)
    positions = rows["tokens_positions"].astype(np.int32)
    # A segment's first token has no predecessor in its document, so it is never a target.
    is_target = (rows["loss_mask"] > 0) & (segment_ids > 0) & (positions > 0)
    return {
        "tokens": rows["tokens"].astype(np.int32),
        "segment_ids": segment_ids,
        "positions": positions,
        "loss_mask": is_target.astype(np.float32),
    }


def batch_rows(rows: grain.IterDataset, batch_size: int) -> grain.IterDataset:
  """[B, T] batches in the contract above; an incomplete final batch is dropped."""
  return rows.batch(batch_size, drop_remainder=True).map(PackedRowsToBatch())


def fill_ratio(batch: dict[str, np.ndarray]) -> float:
  """Fraction of positions holding a real token (segment_ids > 0)."""
  return float(np.mean(batch["segment_ids"] > 0))
