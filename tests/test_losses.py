"""Tests for c2/losses.py: closed forms, full-logits references, chunking and gradients."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from c2 import losses
from c2.mesh import make_mesh


def _random_problem(num_tokens, width=8, vocab=24, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  hidden = jax.random.normal(keys[0], (num_tokens, width))
  kernel = jax.random.normal(keys[1], (width, vocab))
  targets = jax.random.randint(keys[2], (num_tokens,), 0, vocab)
  weights = (jax.random.uniform(keys[3], (num_tokens,)) > 0.3).astype(jnp.float32)
  return hidden, kernel, targets, weights


def _reference_xent(hidden, kernel, targets, weights, z_loss_weight=0.0):
  """Full [N,V] logits: the specification the chunked version must match."""
  logits = hidden.astype(jnp.float32) @ kernel.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
  return {
      "loss_sum": jnp.sum(weights * (lse - target_logit)),
      "z_loss_sum": z_loss_weight * jnp.sum(weights * lse**2),
      "correct_sum": jnp.sum(weights * (jnp.argmax(logits, -1) == targets)),
      "weight_sum": jnp.sum(weights),
  }


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


# ----------------------------------------------------------------------- cross-entropy


def test_xent_uniform_logits_is_log_vocab_and_z_loss_is_lse_squared():
  vocab, num_tokens = 32, 5
  hidden = jnp.ones((num_tokens, 4))
  kernel = jnp.zeros((4, vocab))  # every logit 0: p = 1/V, lse = log V
  weights = jnp.array([1.0, 1.0, 0.5, 0.0, 1.0])
  out = losses.chunked_softmax_xent(hidden, kernel, jnp.arange(num_tokens), weights,
                                    chunk_size=2, z_loss_weight=1e-2)
  np.testing.assert_allclose(out["loss_sum"], 3.5 * math.log(vocab), rtol=1e-6)
  np.testing.assert_allclose(out["z_loss_sum"], 1e-2 * 3.5 * math.log(vocab)**2, rtol=1e-6)
  np.testing.assert_allclose(out["weight_sum"], 3.5)


@pytest.mark.parametrize("num_tokens,chunk_size", [(37, 8), (16, 16), (5, 64), (40, 7)])
def test_xent_matches_full_logits_and_grads(num_tokens, chunk_size):
  hidden, kernel, targets, weights = _random_problem(num_tokens)
  out = losses.chunked_softmax_xent(hidden, kernel, targets, weights, chunk_size=chunk_size,
                                    z_loss_weight=1e-3)
  ref = _reference_xent(hidden, kernel, targets, weights, z_loss_weight=1e-3)
  for name in ref:
    np.testing.assert_allclose(out[name], ref[name], rtol=1e-5, atol=1e-5, err_msg=name)

  def total(fn, **kw):
    def loss(h, k):
      o = fn(h, k, targets, weights, z_loss_weight=1e-3, **kw)
      return o["loss_sum"] + o["z_loss_sum"]
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(hidden, kernel)

  grads = total(losses.chunked_softmax_xent, chunk_size=chunk_size)
  ref_grads = total(_reference_xent)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # Padding tokens carry zero weight, so they must not receive gradient either.
  zero_rows = np.asarray(weights) == 0
  np.testing.assert_array_equal(np.asarray(grads[0])[zero_rows], 0.0)


def test_xent_bf16_inputs_accumulate_in_float32():
  hidden, kernel, targets, weights = _random_problem(24, width=64, vocab=40)
  out = losses.chunked_softmax_xent(hidden.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16),
                                    targets, weights, chunk_size=8)
  ref = _reference_xent(hidden.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16), targets,
                        weights)
  assert out["loss_sum"].dtype == jnp.float32
  np.testing.assert_allclose(out["loss_sum"], ref["loss_sum"], rtol=1e-5)


def _largest_intermediate(jaxpr) -> int:
  """Largest array size produced anywhere in a jaxpr, sub-jaxprs (scan, remat) included."""
  largest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      largest = max(largest, math.prod(getattr(var.aval, "shape", ())))
    for sub in jax.core.jaxprs_in_params(eqn.params):
      largest = max(largest, _largest_intermediate(sub))
  return largest


def test_xent_and_kl_never_hold_more_than_a_chunk_of_logits():
  num_tokens, width, vocab, chunk = 64, 4, 512, 8
  hidden, kernel, targets, weights = _random_problem(num_tokens, width=width, vocab=vocab)

  def xent(h, k):
    return losses.chunked_softmax_xent(h, k, targets, weights, chunk_size=chunk)["loss_sum"]

  def kl(h, k):
    return losses.chunked_distill_kl(h, 2 * h, k, weights, chunk_size=chunk)["kl_sum"]

  for fn in (xent, kl):
    jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(hidden, kernel).jaxpr
    # The kernel gradient itself is [D,V]; logits of every token would be N*V = 16x more.
    assert _largest_intermediate(jaxpr) <= max(chunk * vocab, width * vocab)


def test_xent_under_data_parallel_sharding_matches_unsharded_without_gathers():
  mesh = make_mesh({"data": 8})  # the trainer's mesh: Auto axes, GSPMD propagation
  hidden, kernel, targets, weights = _random_problem(64, vocab=16)
  sharded = jax.device_put((hidden, targets, weights),
                           (NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P("data")),
                            NamedSharding(mesh, P("data"))))

  def loss(h, k, t, w):
    return losses.chunked_softmax_xent(h, k, t, w, chunk_size=16)["loss_sum"]

  value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  value, _ = value_and_grad(sharded[0], kernel, *sharded[1:])
  np.testing.assert_allclose(value, _reference_xent(hidden, kernel, targets, weights)["loss_sum"],
                             rtol=1e-5)
  # Strided chunks keep every token on its device: only the sums and the kernel grad are reduced.
  hlo = value_and_grad.lower(sharded[0], kernel, *sharded[1:]).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo


# ------------------------------------------------------------------ MTP self-distillation


def _reference_kl(student, teacher, kernel, weights):
  log_ps = np.asarray(jax.nn.log_softmax(np.asarray(student, np.float64) @ np.asarray(kernel)))
  log_pt = np.asarray(jax.nn.log_softmax(np.asarray(teacher, np.float64) @ np.asarray(kernel)))
  pt, ps = np.exp(log_pt), np.exp(log_ps)
  w = np.asarray(weights)
  return {
      "kl_sum": np.sum(w * np.sum(pt * (log_pt - log_ps), -1)),
      "top1_agree_sum": np.sum(w * (ps.argmax(-1) == pt.argmax(-1))),
      "accept_sum": np.sum(w * np.minimum(pt, ps).sum(-1)),
      "weight_sum": np.sum(w),
  }


def test_kl_is_zero_for_identical_distributions():
  hidden, kernel, _, weights = _random_problem(13)
  out = losses.chunked_distill_kl(hidden, hidden, kernel, weights, chunk_size=4)
  np.testing.assert_allclose(out["kl_sum"], 0.0, atol=1e-5)
  np.testing.assert_allclose(out["top1_agree_sum"], out["weight_sum"])
  np.testing.assert_allclose(out["accept_sum"], out["weight_sum"], rtol=1e-5)


@pytest.mark.parametrize("num_tokens,chunk_size", [(13, 4), (8, 32)])
def test_kl_matches_numpy(num_tokens, chunk_size):
  student, kernel, _, weights = _random_problem(num_tokens, seed=1)
  teacher, _, _, _ = _random_problem(num_tokens, seed=2)
  out = losses.chunked_distill_kl(student, teacher, kernel, weights, chunk_size=chunk_size)
  ref = _reference_kl(student, teacher, kernel, weights)
  for name in ref:
    np.testing.assert_allclose(out[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
  assert out["kl_sum"] > 0.1


def test_kl_gradient_reaches_student_and_head_but_not_teacher():
  student, kernel, _, weights = _random_problem(10, seed=3)
  teacher, _, _, _ = _random_problem(10, seed=4)

  def kl(s, t, k):
    return losses.chunked_distill_kl(s, t, k, weights, chunk_size=4)["kl_sum"]

  g_student, g_teacher, g_kernel = jax.jit(jax.grad(kl, argnums=(0, 1, 2)))(student, teacher,
                                                                            kernel)
  assert float(jnp.abs(g_student).max()) > 1e-3
  assert float(jnp.abs(g_kernel).max()) > 1e-3
  np.testing.assert_array_equal(g_teacher, 0.0)
  # d KL / d student_logits = p_s - p_t, pulled back through the head.
  p_s = jax.nn.softmax(student @ kernel)
  p_t = jax.nn.softmax(teacher @ kernel)
  np.testing.assert_allclose(g_student, (weights[:, None] * (p_s - p_t)) @ kernel.T, atol=1e-5)
  # A frozen head keeps the distillation gradient in the MTP layers only.
  g_closed = jax.grad(lambda k: kl(student, teacher, jax.lax.stop_gradient(k)))(kernel)
  np.testing.assert_array_equal(g_closed, 0.0)


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


def test_every_auxiliary_loss_is_nonzero_with_nonzero_gradient():
  """Guards against an auxiliary term silently becoming zero (a wrong mask, a lost weight)."""
  hidden, kernel, targets, weights = _random_problem(12, seed=6)
  teacher, _, _, _ = _random_problem(12, seed=7)

  def z_loss(h):
    return losses.chunked_softmax_xent(h, kernel, targets, weights, chunk_size=4,
                                       z_loss_weight=1e-4)["z_loss_sum"]

  def distill(h):
    return losses.chunked_distill_kl(h, teacher, kernel, weights, chunk_size=4)["kl_sum"]

  scores = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(8), (2, 6, 4)))
  topk_idx = jax.lax.top_k(scores, 2)[1]

  def balance(s):
    return losses.sequence_balance_loss(s, topk_idx, jnp.ones((2, 6)), num_experts=4, top_k=2)

  for name, fn, arg in [("z_loss", z_loss, hidden), ("distill", distill, hidden),
                        ("balance", balance, scores)]:
    value, grad = jax.jit(jax.value_and_grad(fn))(arg)
    assert float(value) > 0, name
    assert float(jnp.abs(grad).max()) > 0, name
