"""Tests for c2/losses.py: targets, shifts, MoE balance and bias rules (the head losses are in
tests/test_head_loss.py)."""
import math

import jax
import jax.numpy as jnp
import numpy as np

from c2 import losses


# ------------------------------------------------------------------------------ targets


def test_shift_left_zero_fills():
  x = jnp.arange(10).reshape(2, 5)
  np.testing.assert_array_equal(losses.shift_left(x, 2), [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]])
  np.testing.assert_array_equal(losses.shift_left(x, 0), x)
  np.testing.assert_array_equal(losses.shift_left(x, 7), jnp.zeros_like(x))


def test_next_token_targets_respect_documents_padding_and_mask():
  tokens = jnp.array([[11, 12, 13, 21, 22, 23, 0, 0]])
  segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 0, 0]])
  # Token 22 (say a prompt token) is not a target; padding never is.
  loss_mask = jnp.array([[1, 1, 1, 1, 0, 1, 0, 0]], jnp.float32)
  targets, weights = losses.next_token_targets(tokens, segment_ids, loss_mask)
  np.testing.assert_array_equal(targets, [[12, 13, 0, 0, 23, 0, 0, 0]])
  np.testing.assert_array_equal(weights, [[1, 1, 0, 0, 1, 0, 0, 0]])
  # MTP depth 1 predicts two ahead: only pairs inside one document survive.
  targets, weights = losses.next_token_targets(tokens, segment_ids, loss_mask, offset=2)
  np.testing.assert_array_equal(targets, [[13, 0, 0, 23, 0, 0, 0, 0]])
  np.testing.assert_array_equal(weights, [[1, 0, 0, 1, 0, 0, 0, 0]])


def test_next_token_targets_last_positions_have_no_target():
  tokens = jnp.arange(1, 7).reshape(1, 6)
  ones = jnp.ones((1, 6))
  _, weights = losses.next_token_targets(tokens, ones.astype(jnp.int32), ones, offset=3)
  np.testing.assert_array_equal(weights, [[1, 1, 1, 0, 0, 0]])


def test_shift_left_aligns_main_head_with_mtp_depth():
  # Main hidden at t+k and MTP depth k at t both predict token t+1+k.
  main = jnp.arange(6.0).reshape(1, 6, 1)
  np.testing.assert_array_equal(losses.shift_left(main, 1)[0, :, 0], [1, 2, 3, 4, 5, 0])


# --------------------------------------------------------------------------- MoE balance


def test_expert_counts_ignores_masked_tokens():
  topk_idx = jnp.array([[0, 1], [1, 2], [3, 3]])
  counts = losses.expert_counts(topk_idx, jnp.array([1.0, 1.0, 0.0]), num_experts=4)
  np.testing.assert_array_equal(counts, [1, 2, 1, 0])


def test_aux_free_bias_update_sign_rule():
  bias = jnp.zeros((2, 4))
  load = jnp.array([[4.0, 2.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]])  # layer 0 mean 2
  new = losses.aux_free_bias_update(bias, load, rate=0.01)
  np.testing.assert_allclose(new, [[-0.01, 0.0, 0.01, 0.01], [0, 0, 0, 0]])
  assert new.dtype == bias.dtype


def _reference_balance(scores, topk_idx, mask, num_experts, top_k):
  scores, topk_idx, mask = map(np.asarray, (scores, topk_idx, mask))
  per_row = []
  for s, idx, m in zip(scores, topk_idx, mask):
    valid = m > 0
    if not valid.any():
      continue
    t = valid.sum()
    counts = np.bincount(idx[valid].ravel(), minlength=num_experts)
    f = num_experts / (top_k * t) * counts
    p = (s[valid] / s[valid].sum(-1, keepdims=True)).sum(0) / t
    per_row.append(np.sum(f * p))
  return np.mean(per_row)


def test_sequence_balance_loss_is_one_when_perfectly_balanced():
  num_experts, top_k, length = 4, 2, 4
  scores = jnp.full((1, length, num_experts), 0.5)
  topk_idx = jnp.array([[[0, 1], [2, 3], [0, 1], [2, 3]]])
  loss = losses.sequence_balance_loss(scores, topk_idx, jnp.ones((1, length)),
                                      num_experts=num_experts, top_k=top_k)
  np.testing.assert_allclose(loss, 1.0, rtol=1e-6)


def test_sequence_balance_loss_matches_numpy_and_has_gradient():
  batch, length, num_experts, top_k = 3, 7, 6, 2
  keys = jax.random.split(jax.random.PRNGKey(5), 2)
  scores = jax.nn.sigmoid(jax.random.normal(keys[0], (batch, length, num_experts)))
  topk_idx = jax.lax.top_k(scores + 0.1 * jax.random.normal(keys[1], scores.shape), top_k)[1]
  mask = jnp.ones((batch, length)).at[1, 4:].set(0).at[2].set(0)  # ragged row, empty row

  def loss_fn(s):
    return losses.sequence_balance_loss(s, topk_idx, mask, num_experts=num_experts,
                                        top_k=top_k)

  loss, grad = jax.jit(jax.value_and_grad(loss_fn))(scores)
  np.testing.assert_allclose(loss, _reference_balance(scores, topk_idx, mask, num_experts,
                                                      top_k), rtol=1e-5)
  assert loss > 0.5
  assert float(jnp.abs(grad).max()) > 1e-4
  np.testing.assert_array_equal(grad[2], 0.0)  # an empty row contributes nothing


def test_collapsed_routing_is_penalised_more_than_balanced():
  num_experts, top_k, length = 8, 2, 16
  scores = jnp.full((1, length, num_experts), 0.1).at[..., :2].set(0.9)
  collapsed = jnp.broadcast_to(jnp.array([0, 1]), (1, length, top_k))
  loss = losses.sequence_balance_loss(scores, collapsed, jnp.ones((1, length)),
                                      num_experts=num_experts, top_k=top_k)
  # f = E/K on the two chosen experts, P = 0.9/(1.8+0.6) each: 2 * 4 * 0.375 = 3.
  np.testing.assert_allclose(loss, 3.0, rtol=1e-5)


def test_load_stats_closed_form():
  stats = losses.load_stats(jnp.array([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]]))
  np.testing.assert_allclose(stats["max_over_mean"], [1.0, 4.0])
  np.testing.assert_allclose(stats["entropy"], [math.log(4), 0.0], atol=1e-6)
  np.testing.assert_allclose(stats["cv"], [0.0, math.sqrt(3)], rtol=1e-6)


# ------------------------------------------------------------- auxiliary losses stay alive


def test_balance_loss_is_nonzero_with_nonzero_gradient():
  """Guards against the balance term silently becoming zero (a wrong mask, a lost weight); the
  head-loss terms have the same guard in tests/test_head_loss.py."""
  scores = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(8), (2, 6, 4)))
  topk_idx = jax.lax.top_k(scores, 2)[1]

  def balance(s):
    return losses.sequence_balance_loss(s, topk_idx, jnp.ones((2, 6)), num_experts=4, top_k=2)

  value, grad = jax.jit(jax.value_and_grad(balance))(scores)
  assert float(value) > 0
  assert float(jnp.abs(grad).max()) > 0