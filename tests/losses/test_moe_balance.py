"""c2/losses/moe_balance.py: expert counts, the aux-loss-free bias rule, the sequence-wise
balance loss and load statistics."""
import math

import jax
import jax.numpy as jnp
import numpy as np

from c2.losses import moe_balance


def test_expert_counts_ignores_masked_tokens():
  topk_idx = jnp.array([[0, 1], [1, 2], [3, 3]])
  counts = moe_balance.expert_counts(topk_idx, jnp.array([1.0, 1.0, 0.0]), num_experts=4)
  np.testing.assert_array_equal(counts, [1, 2, 1, 0])


def test_aux_free_bias_update_sign_rule():
  bias = jnp.zeros((2, 4))
  load = jnp.array([[4.0, 2.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]])  # layer 0 mean 2
  new = moe_balance.aux_free_bias_update(bias, load, rate=0.01)
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
  loss = moe_balance.sequence_balance_loss(scores, topk_idx, jnp.ones((1, length)),
                                      num_experts=num_experts, top_k=top_k)
  np.testing.assert_allclose(loss, 1.0, rtol=1e-6)


def test_sequence_balance_loss_matches_numpy_and_has_gradient():
  batch, length, num_experts, top_k = 3, 7, 6, 2
  keys = jax.random.split(jax.random.PRNGKey(5), 2)
  scores = jax.nn.sigmoid(jax.random.normal(keys[0], (batch, length, num_experts)))
  topk_idx = jax.lax.top_k(scores + 0.1 * jax.random.normal(keys[1], scores.shape), top_k)[1]
  mask = jnp.ones((batch, length)).at[1, 4:].set(0).at[2].set(0)  # ragged row, empty row

  def loss_fn(s):
    return moe_balance.sequence_balance_loss(s, topk_idx, mask, num_experts=num_experts,
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
  loss = moe_balance.sequence_balance_loss(scores, collapsed, jnp.ones((1, length)),
                                      num_experts=num_experts, top_k=top_k)
  # f = E/K on the two chosen experts, P = 0.9/(1.8+0.6) each: 2 * 4 * 0.375 = 3.
  np.testing.assert_allclose(loss, 3.0, rtol=1e-5)


def test_load_stats_closed_form():
  stats = moe_balance.load_stats(jnp.array([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]]))
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
    return moe_balance.sequence_balance_loss(s, topk_idx, jnp.ones((2, 6)), num_experts=4, top_k=2)

  value, grad = jax.jit(jax.value_and_grad(balance))(scores)
  assert float(value) > 0
  assert float(jnp.abs(grad).max()) > 0