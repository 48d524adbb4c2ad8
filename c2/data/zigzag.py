"""The zig-zag row layout for causal load balance under latent context parallelism (host side).

Glossary: B batch rows, T length, P context shards, Z chunk length (T / 2P).

A row is split into 2P chunks; context shard i holds chunks i and 2P-1-i, so in the permuted
row the shard-contiguous slice [2iZ, 2(i + 1)Z) is [chunk i | chunk 2P-1-i]. Under a causal
mask chunk c attends to c + 1 chunks, so every shard gets (i + 1) + (2P - i) = 2P + 1 chunk
pairs of work (c2/ops/context_attention.py); in natural order the last shard would get 4P - 1
and the first 3.

`zigzag_batch` runs in the data pipeline after packing, before the batch goes to devices. It
permutes every [B, T] array, so positions and segment ids travel with their tokens and
attention masks by position. Shifts along T are meaningless in the permuted row, so it first
computes, in natural order, what the loss and the MTP inputs read from later positions - for
each offset k = 1..max_offset the token at t + k and the next-token weight of offset k
(c2.losses.targets.next_token_targets) - and permutes those too; the loss library and the model
use them when present (c2.losses.targets.batch_targets / lookahead_tokens). A batch holding them
is a zig-zag batch (`is_zigzag`); natural-order batches never carry them, so their path is
unchanged.

Which runs use it: `uses_zigzag` - context > 1 with ModelConfig.context_parallel
"latent_all_gather", in the pretraining / long-context / SFT pipelines (c2/train/loop.py). RL
batches (c2/rl/packing.py) stay in natural order: the attention still masks by position and
runs the natural-order chunk plan (correct, less balanced).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from c2.losses import targets as targets_lib


def uses_zigzag(*, context: int, context_parallel: str, phase: str) -> bool:
  """Whether a phase's batches are laid out zig-zag (see the module docstring)."""
  return context > 1 and context_parallel == "latent_all_gather" and phase != "rl"


def permutation(seq_len: int, num_shards: int) -> np.ndarray:
  """perm [T] with zigzag_row = natural_row[perm]: shard i's slice holds chunks i, 2P-1-i."""
  if seq_len % (2 * num_shards):
    raise ValueError(f"zig-zag needs the length ({seq_len}) to be a multiple of 2 x context "
                     f"shards ({2 * num_shards})")
  chunks = np.arange(seq_len).reshape(2 * num_shards, -1)  # [2P, Z]
  order = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
  return chunks[order].reshape(-1)


def inverse_permutation(seq_len: int, num_shards: int) -> np.ndarray:
  """inv [T] with natural_row = zigzag_row[inv]."""
  return np.argsort(permutation(seq_len, num_shards))


def to_zigzag(x: np.ndarray, num_shards: int) -> np.ndarray:
  """[B, T, ...] natural -> zig-zag order along T."""
  return np.take(x, permutation(x.shape[1], num_shards), axis=1)


def from_zigzag(x: np.ndarray, num_shards: int) -> np.ndarray:
  """[B, T, ...] zig-zag -> natural order along T."""
  return np.take(x, inverse_permutation(x.shape[1], num_shards), axis=1)


def _shift_left(x: np.ndarray, k: int) -> np.ndarray:
  """out[:, t] = x[:, t + k], zeros past the row end (c2.losses.targets.shift_left in numpy)."""
  out = np.zeros_like(x)
  if k < x.shape[1]:
    out[:, :x.shape[1] - k] = x[:, k:]
  return out


def lookahead(batch: Mapping[str, np.ndarray], max_offset: int) -> dict[str, np.ndarray]:
  """Natural-order look-ahead arrays for offsets 1..max_offset: the tokens at t + k
  (int32) and the next-token weights of offset k (float32), as next_token_targets defines them."""
  tokens, segments = np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"])
  mask = np.asarray(batch["loss_mask"], np.float32)
  out = {}
  for k in range(1, max_offset + 1):
    tokens_key, weights_key = targets_lib.lookahead_keys(k)
    same_document = (_shift_left(segments, k) == segments) & (segments != 0)
    out[tokens_key] = _shift_left(tokens, k).astype(np.int32)
    out[weights_key] = (_shift_left(mask, k) * same_document).astype(np.float32)
  return out


def zigzag_batch(batch: Mapping[str, np.ndarray], num_shards: int,
                 max_offset: int) -> dict[str, np.ndarray]:
  """A packed natural-order batch of [B, T] arrays -> the same batch in zig-zag order, plus its
  look-ahead arrays for offsets 1..max_offset (the main head needs 1, MTP depth M needs M + 1).
  Arrays that are not [B, T, ...] with the tokens' B and T are refused."""
  if max_offset < 1:
    raise ValueError(f"max_offset must be >= 1 (the next-token target), got {max_offset}")
  if any(targets_lib.lookahead_keys(1)[0] == key for key in batch):
    raise ValueError("batch is already in zig-zag order (it holds look-ahead arrays)")
  rows = np.asarray(batch["tokens"]).shape
  out = {**batch, **lookahead(batch, max_offset)}
  perm = permutation(rows[1], num_shards)
  for key, value in out.items():
    value = np.asarray(value)
    if value.shape[:2] != rows:
      raise ValueError(f"zig-zag: batch array {key!r} has shape {value.shape}, not [B, T] = "
                       f"{rows}; only per-token arrays can be permuted")
    out[key] = np.take(value, perm, axis=1)
  return out


def is_zigzag(batch: Mapping) -> bool:
  """Whether a batch was made by `zigzag_batch` (it carries look-ahead arrays)."""
  return targets_lib.lookahead_keys(1)[0] in batch


class ZigzagTransform:
  """The pipeline's batch transform: callable on a numpy batch dict (picklable, for workers)."""

  def __init__(self, num_shards: int, max_offset: int):
    self.num_shards, self.max_offset = num_shards, max_offset

  def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return zigzag_batch(batch, self.num_shards, self.max_offset)

  def keys(self) -> tuple[str, ...]:
    """The batch keys it adds."""
    return tuple(key for k in range(1, self.max_offset + 1)
                 for key in targets_lib.lookahead_keys(k))


def shift_right_index(seq_len: int, num_shards: int, k: int) -> tuple[np.ndarray, np.ndarray]:
  """(index [T], valid [T] bool) with aligned = where(valid, x[:, index], 0) computing, in
  zig-zag order, natural-order out[n] = x[n - k] (zero for n < k): the MTP alignment
  (c2.losses.head.align_mtp), which pairs a token's MTP state with a main-head state k ahead."""
  perm, inv = permutation(seq_len, num_shards), inverse_permutation(seq_len, num_shards)
  source = perm - k  # natural index each zig-zag slot reads from
  valid = source >= 0
  return inv[np.where(valid, source, 0)], valid


def transform_for(*, context: int, context_parallel: str, phase: str,
                  mtp_depth: int) -> "ZigzagTransform | None":
  """The batch transform a run's pipeline applies (None: natural order). Offsets up to
  mtp_depth + 1: the main head's target and every MTP depth's input token and target."""
  if not uses_zigzag(context=context, context_parallel=context_parallel, phase=phase):
    return None
  return ZigzagTransform(context, mtp_depth + 1)
