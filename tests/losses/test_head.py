"""c2.head_loss: the fused chunked head objective against full-logits autodiff and closed forms."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2.losses import head as head_loss
from c2.losses.head import HeadLossSpec

D, V = 16, 40


def _inputs(num_tokens, depths, seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  hidden = jax.random.normal(keys[0], (num_tokens, D))
  kernel = jax.random.normal(keys[1], (D, V)) / np.sqrt(D)
  targets = jax.random.randint(keys[2], (num_tokens,), 0, V)
  weights = (jax.random.uniform(keys[3], (num_tokens,)) > 0.2).astype(jnp.float32)
  mtp = jax.random.normal(keys[4], (num_tokens, depths, D))
  mtp_w = (jax.random.uniform(keys[5], (num_tokens, depths)) > 0.3).astype(jnp.float32)
  return hidden, kernel, targets, weights, mtp, mtp_w


def _reference(spec, hidden, kernel, targets, weights, mtp, mtp_w):
  """Full [N, V] logits, plain autodiff, the module docstring's formulas."""
  logits = hidden @ kernel
  lse = jax.nn.logsumexp(logits, -1)
  ce = lse - jnp.take_along_axis(logits, targets[:, None], -1)[:, 0]
  focal = jax.lax.stop_gradient((1.0 - jnp.exp(-ce)) ** spec.focal_gamma)
  total = jnp.sum(weights * (focal * ce + spec.z_loss_weight * lse**2)) / jnp.maximum(
      weights.sum(), 1)
  log_p = jax.lax.stop_gradient(jax.nn.log_softmax(logits))
  depths = mtp.shape[1]
  for k in range(depths):
    frozen = jax.lax.stop_gradient(kernel)
    log_q_kl = jax.nn.log_softmax(mtp[:, k] @ frozen)  # the KL never trains the head
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q_kl), -1)
    ce_kernel = kernel if spec.mtp_trains_head else frozen
    log_q_ce = jax.nn.log_softmax(mtp[:, k] @ ce_kernel)
    s_ce = -jnp.take_along_axis(log_q_ce, targets[:, None], -1)[:, 0]
    term = spec.mtp_distill * kl + spec.mtp_ce * s_ce
    total += spec.mtp_weight / depths * jnp.sum(mtp_w[:, k] * term) / jnp.maximum(
        mtp_w[:, k].sum(), 1)
  return total


SPECS = {
    "ce": HeadLossSpec(chunk_size=8),
    "ce+z": HeadLossSpec(chunk_size=7, z_loss_weight=0.1),
    "distill": HeadLossSpec(chunk_size=8, z_loss_weight=1e-2, mtp_weight=0.3),
    "mtp_ce": HeadLossSpec(chunk_size=5, mtp_weight=0.5, mtp_distill=False, mtp_ce=True),
    "distill+ce": HeadLossSpec(chunk_size=64, mtp_weight=0.4, mtp_ce=True),
    "distill+ce,frozen head": HeadLossSpec(chunk_size=3, mtp_weight=0.4, mtp_ce=True,
                                           mtp_trains_head=False),
    "focal": HeadLossSpec(chunk_size=8, focal_gamma=2.0),
    "focal+z+distill": HeadLossSpec(chunk_size=7, z_loss_weight=0.1, mtp_weight=0.3,
                                    focal_gamma=1.5),
}


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("depths", [0, 2])
def test_objective_and_gradients_match_full_logits_autodiff(name, depths):
  spec = SPECS[name]
  hidden, kernel, targets, weights, mtp, mtp_w = _inputs(30, depths)

  def fused(h, k, s):
    return head_loss.head_loss(spec, h, k, targets, weights, s, mtp_w)[0]

  def reference(h, k, s):
    return _reference(spec, h, k, targets, weights, s, mtp_w)

  value, grads = jax.value_and_grad(fused, argnums=(0, 1, 2))(hidden, kernel, mtp)
  ref_value, ref_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(hidden, kernel, mtp)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(grads[1]).max()) > 0
  # the primal (eval) path computes no gradients but the same objective
  np.testing.assert_allclose(fused(hidden, kernel, mtp), ref_value, rtol=1e-5)


@pytest.mark.parametrize("name, depths", [("ce+z", 0), ("distill+ce", 1)])
def test_weighted_only_equals_the_reference_and_skips_chunks_without_weight(name, depths):
  """weighted_only gives the reference objective and gradients, and never computes a chunk of
  unweighted tokens: NaN hidden states there would poison the sums. 16 of 40 tokens carry a
  (main or MTP) weight, in 2 whole chunks of 8 once gathered."""
  spec = dataclasses.replace(SPECS[name], chunk_size=8, weighted_only=True)
  hidden, kernel, targets, _, mtp, _ = _inputs(40, depths, seed=3)
  index = np.random.default_rng(0).permutation(40)
  weights = jnp.zeros(40).at[index[:12 + 4 * (1 - depths)]].set(1.0)
  # with an MTP depth, 4 tokens weigh only for the MTP
  mtp_w = jnp.zeros((40, depths)).at[index[8:16], :].set(1.0)
  weighted = np.asarray((weights > 0) | jnp.any(mtp_w > 0, axis=1))
  poison = lambda x: jnp.where(weighted.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.nan)

  def fused(h, k, s):
    return head_loss.head_loss(spec, h, k, targets, weights, s, mtp_w)[0]

  def reference(h, k, s):
    return _reference(spec, h, k, targets, weights, s, mtp_w)

  value, grads = jax.value_and_grad(fused, argnums=(0, 1, 2))(poison(hidden), kernel, poison(mtp))
  ref_value, ref_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(hidden, kernel, mtp)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  # every token the main loss weighs gets its gradient (the values above are the reference's)
  assert float(jnp.linalg.norm(grads[0][np.asarray(weights) > 0], axis=-1).min()) > 0
  _, metrics = head_loss.head_loss(spec, hidden, kernel, targets, weights, mtp, mtp_w)
  _, full_metrics = head_loss.head_loss(dataclasses.replace(spec, weighted_only=False), hidden,
                                        kernel, targets, weights, mtp, mtp_w)
  for key in metrics:
    np.testing.assert_allclose(metrics[key], full_metrics[key], rtol=1e-5, err_msg=key)


def test_gradient_scales_with_the_cotangent():
  spec = SPECS["distill"]
  hidden, kernel, targets, weights, mtp, mtp_w = _inputs(12, 1)
  grad = lambda scale: jax.grad(
      lambda h: scale * head_loss.head_loss(spec, h, kernel, targets, weights, mtp, mtp_w)[0])(
          hidden)
  np.testing.assert_allclose(grad(-3.0), -3.0 * grad(1.0), rtol=1e-5)


def test_metrics_closed_forms_on_uniform_logits():
  """Zero kernel: uniform distributions, CE = log V, z-loss = w (log V)^2, KL = 0, accept = 1."""
  spec = HeadLossSpec(chunk_size=4, z_loss_weight=0.5, mtp_weight=0.3, mtp_ce=True)
  hidden, _, targets, weights, mtp, mtp_w = _inputs(10, 2)
  _, m = head_loss.head_loss(spec, hidden, jnp.zeros((D, V)), targets, weights, mtp, mtp_w)
  w = float(weights.sum())
  np.testing.assert_allclose(m["ce_sum"], w * np.log(V), rtol=1e-6)
  np.testing.assert_allclose(m["z_loss_sum"], 0.5 * w * np.log(V) ** 2, rtol=1e-6)
  np.testing.assert_allclose(m["weight_sum"], w)
  np.testing.assert_allclose(m["mtp_kl_sum"], [0.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(m["mtp_accept_sum"], mtp_w.sum(0), rtol=1e-6)
  np.testing.assert_allclose(m["mtp_ce_sum"], mtp_w.sum(0) * np.log(V), rtol=1e-6)
  np.testing.assert_allclose(m["mtp_weight_sum"], mtp_w.sum(0))


def test_focal_closed_forms():
  """Uniform logits: each token's term is (1 - 1/V)^gamma log V. A token predicted with
  probability ~1 adds ~nothing to the objective or the gradient; the CE metric is the plain CE."""
  spec = HeadLossSpec(chunk_size=4, focal_gamma=2.0)
  hidden, _, targets, weights, _, _ = _inputs(10, 0)
  value, m = head_loss.head_loss(spec, hidden, jnp.zeros((D, V)), targets, weights)
  np.testing.assert_allclose(value, (1 - 1 / V) ** 2 * np.log(V), rtol=1e-6)
  np.testing.assert_allclose(m["ce_sum"], float(weights.sum()) * np.log(V), rtol=1e-6)

  # Two tokens: one predicted at p ~ 1 (logit margin 30), one at uniform; weights 1 each.
  kernel = jnp.zeros((D, V)).at[0, 3].set(30.0)
  hidden2 = jnp.zeros((2, D)).at[0, 0].set(1.0)  # token 0 sees the margin, token 1 uniform
  targets2, weights2 = jnp.array([3, 5]), jnp.ones((2,))
  loss = lambda h, gamma: head_loss.head_loss(HeadLossSpec(chunk_size=2, focal_gamma=gamma), h,
                                              kernel, targets2, weights2)[0]
  np.testing.assert_allclose(loss(hidden2, 2.0), (1 - 1 / V) ** 2 * np.log(V) / 2, rtol=1e-5)
  grads = jax.grad(loss)(hidden2, 2.0)
  plain = jax.grad(loss)(hidden2, 0.0)
  assert float(jnp.abs(grads[0]).max()) < 1e-20 < float(jnp.abs(grads[1]).max())
  np.testing.assert_allclose(grads[1], (1 - 1 / V) ** 2 * plain[1], rtol=1e-5)


def test_metrics_match_numpy():
  spec = HeadLossSpec(chunk_size=6, mtp_weight=0.3)
  hidden, kernel, targets, weights, mtp, mtp_w = _inputs(20, 1, seed=3)
  _, m = head_loss.head_loss(spec, hidden, kernel, targets, weights, mtp, mtp_w)
  h, k, s = np.asarray(hidden, np.float64), np.asarray(kernel, np.float64), np.asarray(mtp[:, 0])
  log_softmax = lambda z: z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - z.max(-1, keepdims=True)
  log_p, log_q = log_softmax(h @ k), log_softmax(s @ k)
  p, q, w, wk = np.exp(log_p), np.exp(log_q), np.asarray(weights), np.asarray(mtp_w[:, 0])
  t = np.asarray(targets)
  np.testing.assert_allclose(m["ce_sum"], np.sum(w * -log_p[np.arange(20), t]), rtol=1e-5)
  np.testing.assert_allclose(m["correct_sum"], np.sum(w * (p.argmax(-1) == t)))
  np.testing.assert_allclose(m["mtp_kl_sum"][0], np.sum(wk * np.sum(p * (log_p - log_q), -1)),
                             rtol=1e-5)
  np.testing.assert_allclose(m["mtp_top1_agree_sum"][0],
                             np.sum(wk * (p.argmax(-1) == q.argmax(-1))))
  np.testing.assert_allclose(m["mtp_accept_sum"][0], np.sum(wk * np.minimum(p, q).sum(-1)),
                             rtol=1e-5)


def test_align_mtp_pairs_each_student_with_the_main_position_of_its_target():
  """Depth k at position t predicts token t+1+k, as the main head at position t+k does."""
  hidden = jnp.arange(2 * 6, dtype=jnp.float32).reshape(2, 6, 1)
  weights = jnp.ones((2, 6))
  aligned, aligned_w = head_loss.align_mtp(hidden, weights, depth=2)
  np.testing.assert_array_equal(aligned[:, 2:], hidden[:, :4])
  np.testing.assert_array_equal(aligned[:, :2], 0)
  np.testing.assert_array_equal(aligned_w[:, :2], 0)


def test_chunks_hold_at_most_chunk_size_logits():
  """The compiled program never holds the whole [N, V] logits."""
  spec = HeadLossSpec(chunk_size=8, mtp_weight=0.3)
  num_tokens, vocab = 256, 512
  hidden = jnp.ones((num_tokens, D))
  kernel = jnp.ones((D, vocab))
  fn = jax.jit(jax.grad(lambda h, k: head_loss.head_loss(
      spec, h, k, jnp.zeros(num_tokens, jnp.int32), jnp.ones(num_tokens),
      h[:, None], jnp.ones((num_tokens, 1)))[0], argnums=(0, 1)))
  text = fn.lower(hidden, kernel).compile().as_text()
  assert f"f32[{num_tokens},{vocab}]" not in text
  assert f"f32[8,{vocab}]" in text


def test_padding_tokens_get_no_gradient_and_identical_students_no_kl():
  spec = HeadLossSpec(chunk_size=4, mtp_weight=0.3)
  hidden, kernel, targets, weights, _, _ = _inputs(13, 1, seed=5)
  mtp_w = jnp.ones((13, 1))
  (value, m), grad = jax.value_and_grad(
      lambda h: head_loss.head_loss(spec, h, kernel, targets, weights, h[:, None], mtp_w),
      has_aux=True)(hidden)
  del value
  np.testing.assert_allclose(m["mtp_kl_sum"], [0.0], atol=1e-5)
  np.testing.assert_allclose(m["mtp_top1_agree_sum"], [13.0])
  np.testing.assert_allclose(m["mtp_accept_sum"], [13.0], rtol=1e-5)
  # rows with zero main weight get only the (zero at p == q) distillation gradient
  no_weight = np.asarray(weights) == 0
  np.testing.assert_allclose(np.asarray(grad)[no_weight], 0.0, atol=1e-6)


def test_bf16_inputs_accumulate_in_float32():
  spec = HeadLossSpec(chunk_size=8)
  hidden, kernel, targets, weights, _, _ = _inputs(24, 0)
  bf16 = lambda x: x.astype(jnp.bfloat16)
  value, m = head_loss.head_loss(spec, bf16(hidden), bf16(kernel), targets, weights)
  ref = _reference(spec, bf16(hidden).astype(jnp.float32), bf16(kernel).astype(jnp.float32),
                   targets, weights, jnp.zeros((24, 0, D)), jnp.zeros((24, 0)))
  assert value.dtype == jnp.float32 and m["ce_sum"].dtype == jnp.float32
  np.testing.assert_allclose(value, ref, rtol=1e-5)
  grads = jax.grad(lambda h, k: head_loss.head_loss(spec, h, k, targets, weights)[0],
                   argnums=(0, 1))(bf16(hidden), bf16(kernel))
  assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16


def test_every_head_loss_term_is_nonzero_with_nonzero_gradient():
  """Guards against a term silently becoming zero (a wrong mask, a lost weight)."""
  hidden, kernel, targets, weights, mtp, mtp_w = _inputs(12, 1, seed=6)
  base = HeadLossSpec(chunk_size=4)
  terms = {"z_loss": HeadLossSpec(chunk_size=4, z_loss_weight=1e-2),
           "distill": HeadLossSpec(chunk_size=4, mtp_weight=0.3),
           "mtp_ce": HeadLossSpec(chunk_size=4, mtp_weight=0.3, mtp_distill=False, mtp_ce=True)}
  for name, spec in terms.items():
    term = lambda h, s, spec=spec: (
        head_loss.head_loss(spec, h, kernel, targets, weights, s, mtp_w)[0]
        - head_loss.head_loss(base, h, kernel, targets, weights, s, mtp_w)[0])
    value, grads = jax.value_and_grad(term, argnums=(0, 1))(hidden, mtp)
    assert float(value) > 0, name
    assert float(jnp.abs(grads[1] if name != "z_loss" else grads[0]).max()) > 0, name


def test_data_parallel_sharding_matches_unsharded_without_gathers():
  """Strided chunks keep every token on its device: only sums and the kernel grad reduce."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from c2.parallel.mesh import make_mesh  # pylint: disable=import-outside-toplevel
  mesh = make_mesh({"data": 8})  # the trainer's mesh: Auto axes, GSPMD propagation
  spec = HeadLossSpec(chunk_size=16, mtp_weight=0.3)
  hidden, kernel, targets, weights, mtp, mtp_w = _inputs(64, 1)
  rows = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (x.ndim - 1)))))
  args = [rows(x) for x in (hidden, targets, weights, mtp, mtp_w)]

  def loss(h, k, t, w, s, sw):
    return head_loss.head_loss(spec, h, k, t, w, s, sw)[0]

  value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 4)))
  value, _ = value_and_grad(args[0], kernel, *args[1:])
  np.testing.assert_allclose(value, _reference(spec, hidden, kernel, targets, weights, mtp, mtp_w),
                             rtol=1e-5)
  hlo = value_and_grad.lower(args[0], kernel, *args[1:]).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo
