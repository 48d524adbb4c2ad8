"""RL batch packing: the exact layout of every per-token array, router records at their
[y, b, t, k] places, shard balance against naive in-order packing, leftovers, errors, and
rl_loss accepting the packed dict."""
import functools

import jax
import numpy as np
import pytest

from c2 import model
from c2.losses.rl import RLLossWeights, rl_loss
from c2.model.router import NOT_RECORDED
from c2.rl.packing import TrainSequence, pack_rl_batch


def _seq(tokens, prompt, advantage, routes=None, ref=False, y=1, k=2):
  """Tokens with the first `prompt` unmasked; sampler_logp = -token / 100 on sampled tokens."""
  tokens = np.asarray(tokens, np.int32)
  mask = (np.arange(len(tokens)) >= prompt).astype(np.float32)
  return TrainSequence(tokens=tokens, loss_mask=mask, sampler_logp=-tokens / 100.0 * mask,
                       advantage=advantage, routes=routes,
                       ref_logp=(-tokens / 50.0).astype(np.float32) if ref else None)


def test_layout_values_land_on_their_tokens():
  # Costs (row_len 8, weight 1): a 7 -> 13.1, b 3 -> 4.1, c 2 -> 2.5. a goes to shard 0 (row 0),
  # b to shard 1 (row 1), c to shard 1 (cost 4.1 < 13.1; row 1 has room after b).
  a, b, c = _seq([11, 12, 13, 14, 15, 16, 17], 3, 0.5), _seq([21, 22, 23], 1, -2.0), \
      _seq([31, 32], 1, 1.5)
  batch, stats, leftover = pack_rl_batch([a, b, c], rows=2, row_len=8, shards=2,
                                         with_routes=False)
  assert leftover == [] and stats.dropped == 0
  assert set(batch) == {"tokens", "segment_ids", "positions", "loss_mask", "advantages",
                        "sampler_logp"}
  np.testing.assert_array_equal(batch["tokens"], [[11, 12, 13, 14, 15, 16, 17, 0],
                                                  [21, 22, 23, 31, 32, 0, 0, 0]])
  np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 1, 1, 1, 1, 0],
                                                       [1, 1, 1, 2, 2, 0, 0, 0]])
  np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 4, 5, 6, 0],
                                                     [0, 1, 2, 0, 1, 0, 0, 0]])
  np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 0, 1, 1, 1, 1, 0],
                                                     [0, 1, 1, 0, 1, 0, 0, 0]])
  np.testing.assert_allclose(batch["advantages"], [[0, 0, 0, .5, .5, .5, .5, 0],
                                                   [0, -2, -2, 0, 1.5, 0, 0, 0]])
  np.testing.assert_allclose(batch["sampler_logp"], [[0, 0, 0, -.14, -.15, -.16, -.17, 0],
                                                     [0, -.22, -.23, 0, -.32, 0, 0, 0]], atol=1e-6)
  for name in ("tokens", "segment_ids", "positions"):
    assert batch[name].dtype == np.int32
  for name in ("loss_mask", "advantages", "sampler_logp"):
    assert batch[name].dtype == np.float32
  assert stats.shard_tokens == [7, 5] and stats.shard_attention == [49, 13]
  assert stats.fill == 12 / 16

  # ref_logp appears only when every sequence has one, and mixing is an error.
  with_ref = [_seq([1, 2], 0, 1.0, ref=True), _seq([3, 4, 5], 1, 1.0, ref=True)]
  batch, _, _ = pack_rl_batch(with_ref, rows=2, row_len=4, shards=1, with_routes=False)
  np.testing.assert_allclose(batch["ref_logp"][0, :3], [-.06, -.08, -.1], atol=1e-6)
  with pytest.raises(ValueError, match="ref_logp"):
    pack_rl_batch(with_ref + [_seq([6], 0, 1.0)], rows=2, row_len=4, shards=1, with_routes=False)


def test_forced_routes_at_their_places_and_not_recorded_elsewhere():
  y, k = 2, 3
  routes_a = np.arange(3 * y * k, dtype=np.uint16).reshape(3, y, k)  # tokens 0..2 of a 4-token seq
  routes_a[1, 1, 2] = np.iinfo(np.uint16).max  # a wrapped -1: not recorded
  routes_b = (100 + np.arange(2 * y * k, dtype=np.int32)).reshape(2, y, k)
  a = _seq([5, 6, 7, 8], 1, 1.0, routes=routes_a)
  b = _seq([9, 10], 1, 1.0, routes=routes_b)
  c = _seq([11, 12], 1, 1.0)  # no record at all: routes itself
  batch, _, _ = pack_rl_batch([a, b, c], rows=2, row_len=5, shards=1, with_routes=True,
                              moe_layers=y, top_k=k)
  routes = batch["forced_routes"]
  assert routes.shape == (y, 2, 5, k) and routes.dtype == np.int32
  # FFD: a (4) -> row 0 [0:4]; b and c (2 each, b first by input order) -> row 1 [0:2], [2:4].
  np.testing.assert_array_equal(batch["tokens"], [[5, 6, 7, 8, 0], [9, 10, 11, 12, 0]])
  expected = np.full((y, 2, 5, k), NOT_RECORDED, np.int32)
  expected[:, 0, 0:3] = routes_a.astype(np.int32).transpose(1, 0, 2)
  expected[1, 0, 1, 2] = NOT_RECORDED
  expected[:, 1, 0:2] = routes_b.transpose(1, 0, 2)
  np.testing.assert_array_equal(routes, expected)
  assert routes[0, 0, 2, 1] == 2 * y * k + 1  # spot check: token 2, layer 0, slot 1
  assert routes[1, 1, 1, 0] == 100 + (1 * y + 1) * k

  with pytest.raises(ValueError, match="routes shape"):
    pack_rl_batch([a], rows=1, row_len=5, shards=1, with_routes=True, moe_layers=y, top_k=k + 1)


def _naive_shard_tokens(lengths, rows, row_len, shards):
  """In-order first-fit over rows 0, 1, ... of the whole batch (no balancing)."""
  free, per_shard, tokens = [row_len] * rows, rows // shards, [0] * shards
  for n in lengths:
    row = next((r for r in range(rows) if free[r] >= n), None)
    if row is not None:
      free[row] -= n
      tokens[row // per_shard] += n
  return tokens


def test_shards_balance_tokens_and_attention_better_than_in_order_packing():
  rng = np.random.default_rng(0)
  lengths = rng.integers(8, 257, size=64).tolist()
  seqs = [_seq(np.full(n, i + 1), 4, 1.0) for i, n in enumerate(lengths)]
  rows, row_len, shards = 48, 256, 4
  batch, stats, leftover = pack_rl_batch(seqs, rows=rows, row_len=row_len, shards=shards,
                                         with_routes=False)
  assert leftover == []
  assert stats.token_imbalance < 1.1, stats
  assert stats.cost_imbalance < 1.2, stats
  per_shard = batch["segment_ids"].reshape(shards, -1) > 0
  assert per_shard.sum(-1).tolist() == stats.shard_tokens
  naive = _naive_shard_tokens(lengths, rows, row_len, shards)
  assert sum(naive) == sum(stats.shard_tokens)
  assert max(naive) / np.mean(naive) > stats.token_imbalance + 0.2
  # Deterministic for the same input.
  again, _, _ = pack_rl_batch(seqs, rows=rows, row_len=row_len, shards=shards, with_routes=False)
  for name in batch:
    np.testing.assert_array_equal(batch[name], again[name])


def test_overflow_goes_to_leftover_without_loss_or_duplication():
  rng = np.random.default_rng(1)
  lengths = rng.integers(3, 17, size=40).tolist()  # ~400 tokens into 4 x 16 = 64
  seqs = [_seq(np.full(n, i + 1), 1, 1.0) for i, n in enumerate(lengths)]
  batch, stats, leftover = pack_rl_batch(seqs, rows=4, row_len=16, shards=2, with_routes=False)
  assert stats.dropped == len(leftover) > 0
  # Every sequence's token value is its id + 1: read the packed ids back per segment.
  packed = []
  for row_tokens, row_segments in zip(batch["tokens"], batch["segment_ids"]):
    for segment in np.unique(row_segments[row_segments > 0]):
      values = np.unique(row_tokens[row_segments == segment])
      assert len(values) == 1
      packed.append(int(values[0]) - 1)
  left = [int(s.tokens[0]) - 1 for s in leftover]
  assert sorted(packed + left) == list(range(len(seqs)))
  assert left == sorted(left)  # leftover keeps input order
  assert all(len(seqs[i].tokens) == np.sum(batch["tokens"] == i + 1) for i in packed)


def test_errors_name_the_limit():
  with pytest.raises(ValueError, match=r"9 tokens > row_len=8.*raise row_len"):
    pack_rl_batch([_seq(np.arange(9), 1, 1.0)], rows=2, row_len=8, shards=1, with_routes=False)
  with pytest.raises(ValueError, match="multiple of shards"):
    pack_rl_batch([_seq([1, 2], 1, 1.0)], rows=6, row_len=8, shards=4, with_routes=False)


def test_rl_loss_accepts_the_packed_batch(small_cfg):
  y, k = small_cfg.num_moe_layers, small_cfg.experts_per_token
  rng = np.random.default_rng(2)
  seqs = []
  for i, n in enumerate([10, 6, 5, 9]):
    routes = rng.integers(0, small_cfg.num_routed_experts, (n - 1, y, k)).astype(np.uint16)
    seq = _seq(rng.integers(2, small_cfg.vocab_size, n), 3, (-1.0) ** i, routes=routes, ref=True)
    seqs.append(seq)
  batch, stats, leftover = pack_rl_batch(seqs, rows=2, row_len=16, shards=2, with_routes=True,
                                         moe_layers=y, top_k=k)
  assert leftover == [] and stats.fill == 30 / 32
  # Small random params of init's shapes: compiling init costs ~20 s on a shared CPU, and the
  # check here is only that rl_loss accepts the packed dict (the loss itself is tested elsewhere).
  shapes = jax.eval_shape(functools.partial(model.init_params, small_cfg), jax.random.key(0))
  params = jax.tree.map(lambda s: (rng.normal(0, 0.05, s.shape) if s.ndim > 1 else
                                   np.ones(s.shape)).astype(s.dtype), shapes)
  weights = RLLossWeights(normalizer=32.0, chunk_size=16)
  # One compile is much faster on CPU than running the model op by op.
  loss, aux = jax.jit(lambda p, b: rl_loss(small_cfg, p, b, weights))(params, batch)
  assert np.isfinite(float(loss))
  assert float(aux["metrics"]["rl/tokens"]) == float(np.sum(batch["loss_mask"]))
