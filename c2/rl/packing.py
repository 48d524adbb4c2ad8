"""Packs graded rollout sequences into the RL learner's [B, T] batch, balanced across data shards.

The batch's rows are split by the batch sharding into P contiguous blocks of B / P rows, one per
data-parallel shard, and the step waits for the slowest shard. In-order packing fills the first
shards and leaves the last ones half empty; here every sequence goes to the shard with the lowest
running cost (longest first), so tokens *and* attention work come out near-equal per shard:

  cost(n) = n + attention_weight * n^2 / T     linear work per token + causal attention work
  for each sequence, cost descending (stable):  shard = argmin cost among shards with room
                                                row   = first row of that shard with room

Usage (the RL trainer, once per optimizer step):

  batch, stats, leftover = pack_rl_batch(graded, rows=B, row_len=T, shards=mesh.shape["data"],
                                         with_routes=True, moe_layers=cfg.num_moe_layers,
                                         top_k=cfg.experts_per_token)
  pending = leftover + next_rollouts   # sequences that fit nowhere wait for the next batch
  loss, aux = rl_loss(cfg, params, batch, weights); writer.scalars(stats.metrics())

Glossary: B rows, T row length, P data shards, n one sequence's length, Y MoE layers,
K experts per token.

The batch is the contract of c2/losses/rl.py: tokens, segment_ids (1, 2, ... per sequence in its
row, 0 = padding) and positions (0, 1, ... restarting per sequence) int32 [B, T]; loss_mask,
advantages, sampler_logp (and ref_logp when every sequence has one) float32 [B, T]; forced_routes
int32 [Y, B, T, K] with NOT_RECORDED on padding and on tokens without a record.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from c2.model.router import NOT_RECORDED


@dataclasses.dataclass
class TrainSequence:
  """One graded rollout context; every per-token array is indexed by the token it describes."""

  tokens: np.ndarray  # int32 [n]: prompt + sampled tokens (+ later turns)
  loss_mask: np.ndarray  # bool/float [n]: 1 on tokens the policy sampled
  sampler_logp: np.ndarray  # float32 [n]: the sampler's log-prob of each sampled token, 0 elsewhere
  advantage: float  # the rollout chain's advantage, put on every model token of it
  # uint16/int32 [m <= n, Y, K]: recorded experts per fed token (the engine records n - 1 rows;
  # missing rows, negative values and an unsigned dtype's max are NOT_RECORDED).
  routes: Optional[np.ndarray] = None
  ref_logp: Optional[np.ndarray] = None  # float32 [n]
  group: int = 0  # group id, for metrics and debugging only


@dataclasses.dataclass
class PackStats:
  """What one packed batch looks like per shard (attention cost = sum of n^2 of its sequences)."""

  rows: int
  row_len: int
  shards: int
  shard_tokens: list[int]
  shard_attention: list[int]
  token_imbalance: float  # max / mean of shard_tokens (1.0 = perfect)
  cost_imbalance: float  # max / mean of shard_attention
  fill: float  # real tokens / (B * T)
  dropped: int  # sequences that fit nowhere, returned as leftover

  def metrics(self) -> dict[str, float]:
    return {"rl/pack_fill": self.fill, "rl/pack_token_imbalance": self.token_imbalance,
            "rl/pack_cost_imbalance": self.cost_imbalance, "rl/pack_leftover": float(self.dropped)}


def _imbalance(values: Sequence[float]) -> float:
  mean = float(np.mean(values)) if len(values) else 0.0
  return float(max(values)) / mean if mean > 0 else 1.0


def _check(i: int, seq: TrainSequence, row_len: int) -> int:
  n = len(seq.tokens)
  if n > row_len:
    raise ValueError(f"sequence {i} has {n} tokens > row_len={row_len}: raise row_len or cap the "
                     f"rollouts' max context (prompt + completion) at {row_len}")
  for name in ("loss_mask", "sampler_logp", "ref_logp"):
    value = getattr(seq, name)
    if value is not None and np.shape(value) != (n,):
      raise ValueError(f"sequence {i}: {name} has shape {np.shape(value)}, tokens ({n},)")
  return n


def _routes_int32(seq_routes: np.ndarray, n: int, moe_layers: int, top_k: int, i: int
                  ) -> np.ndarray:
  """[m, Y, K] uint16/int -> int32 [m, Y, K] with every unrecorded entry NOT_RECORDED."""
  if seq_routes.ndim != 3 or seq_routes.shape[0] > n or seq_routes.shape[1:] != (moe_layers, top_k):
    raise ValueError(f"sequence {i}: routes shape {seq_routes.shape}, expected [<= {n}, "
                     f"{moe_layers}, {top_k}] (tokens, moe_layers, top_k)")
  routes = seq_routes.astype(np.int32)
  unrecorded = routes < 0
  if np.issubdtype(seq_routes.dtype, np.unsignedinteger):
    # -1 stored in an unsigned array wraps to the dtype's max; no expert index comes close to it.
    unrecorded |= seq_routes == np.iinfo(seq_routes.dtype).max
  return np.where(unrecorded, NOT_RECORDED, routes)


def _assign(lengths: list[int], *, rows: int, row_len: int, shards: int,
            attention_weight: float) -> tuple[dict[int, tuple[int, int]], list[int]]:
  """-> ({sequence: (row, start)}, leftover sequence indices in input order)."""
  per_shard = rows // shards
  free = [row_len] * rows  # room left in each row
  shard_cost = [0.0] * shards
  cost = [n + attention_weight * n * n / row_len for n in lengths]
  # Longest first, ties in input order: deterministic and the classic FFD/LPT ordering.
  order = sorted(range(len(lengths)), key=lambda i: -cost[i])
  placed, leftover = {}, []
  for i in order:
    n = lengths[i]
    for shard in sorted(range(shards), key=lambda s: (shard_cost[s], s)):
      block = range(shard * per_shard, (shard + 1) * per_shard)
      row = next((r for r in block if free[r] >= n), None)
      if row is not None:
        placed[i] = (row, row_len - free[row])
        free[row] -= n
        shard_cost[shard] += cost[i]
        break
    else:
      leftover.append(i)
  return placed, sorted(leftover)


def pack_rl_batch(sequences: Sequence[TrainSequence], *, rows: int, row_len: int, shards: int,
                  attention_weight: float = 1.0, with_routes: bool, moe_layers: int = 0,
                  top_k: int = 0, pad_id: int = 0
                  ) -> tuple[dict[str, np.ndarray], PackStats, list[TrainSequence]]:
  """Packs sequences into a [rows, row_len] batch whose P = `shards` row blocks carry near-equal
  tokens and attention cost -> (batch, stats, leftover).

  attention_weight: how much a full-row sequence's attention costs relative to its per-token
    (projection + MLP) work; 0 balances tokens only.
  leftover: the sequences that fit nowhere once the batch is full, in input order; the caller
    carries them to the next batch (they are not trained on in this one).
  Raises ValueError if rows % shards, or a sequence is longer than row_len (this module never
  cuts a rollout: a cut would drop the tokens its advantage was earned on).
  """
  if rows <= 0 or shards <= 0 or rows % shards:
    raise ValueError(f"rows={rows} must be a positive multiple of shards={shards} (each data "
                     f"shard holds rows / shards contiguous rows)")
  if with_routes and (moe_layers < 1 or top_k < 1):
    raise ValueError(f"with_routes needs moe_layers >= 1 and top_k >= 1, got {moe_layers}, {top_k}")
  lengths = [_check(i, seq, row_len) for i, seq in enumerate(sequences)]
  placed, leftover = _assign(lengths, rows=rows, row_len=row_len, shards=shards,
                             attention_weight=attention_weight)

  has_ref = [sequences[i].ref_logp is not None for i in placed]
  if any(has_ref) and not all(has_ref):
    raise ValueError("ref_logp is set on some sequences and not others: the KL term would "
                     "silently skip the rest; compute it for all or none")
  shape = (rows, row_len)
  batch = {"tokens": np.full(shape, pad_id, np.int32),
           "segment_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32),
           "loss_mask": np.zeros(shape, np.float32), "advantages": np.zeros(shape, np.float32),
           "sampler_logp": np.zeros(shape, np.float32)}
  if has_ref and all(has_ref):
    batch["ref_logp"] = np.zeros(shape, np.float32)
  if with_routes:
    batch["forced_routes"] = np.full((moe_layers, rows, row_len, top_k), NOT_RECORDED, np.int32)

  segments = [0] * rows
  per_shard = rows // shards
  shard_tokens, shard_attention = [0] * shards, [0] * shards
  for i in sorted(placed, key=placed.get):  # left to right in each row: segment ids 1, 2, ...
    (row, start), seq, n = placed[i], sequences[i], lengths[i]
    span = slice(start, start + n)
    segments[row] += 1
    mask = np.asarray(seq.loss_mask, np.float32)
    batch["tokens"][row, span] = seq.tokens
    batch["segment_ids"][row, span] = segments[row]
    batch["positions"][row, span] = np.arange(n)
    batch["loss_mask"][row, span] = mask
    batch["advantages"][row, span] = np.float32(seq.advantage) * (mask > 0)
    batch["sampler_logp"][row, span] = seq.sampler_logp
    if "ref_logp" in batch:
      batch["ref_logp"][row, span] = seq.ref_logp
    if with_routes and seq.routes is not None:
      routes = _routes_int32(np.asarray(seq.routes), n, moe_layers, top_k, i)  # [m, Y, K]
      batch["forced_routes"][:, row, start:start + len(routes)] = routes.transpose(1, 0, 2)
    shard_tokens[row // per_shard] += n
    shard_attention[row // per_shard] += n * n

  stats = PackStats(rows=rows, row_len=row_len, shards=shards, shard_tokens=shard_tokens,
                    shard_attention=shard_attention, token_imbalance=_imbalance(shard_tokens),
                    cost_imbalance=_imbalance(shard_attention),
                    fill=sum(shard_tokens) / (rows * row_len), dropped=len(leftover))
  return batch, stats, [sequences[i] for i in leftover]
