"""The RL objective against closed forms: Dr. GRPO advantages, chain broadcast, the constant
normaliser, gradients with truncated IS and both k1 placements, mismatch metrics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2.losses import policy_gradient as pg

B, T, Z = 4, 6, 100.0


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  logp = rng.uniform(-3.0, -0.1, (B, T)).astype(np.float32)
  # Sampler log-probs off by up to +-1.2: some ratios exceed a cap of 2 (log 2 = 0.69), some not.
  sampler = (logp - rng.uniform(-1.2, 1.2, (B, T))).astype(np.float32)
  ref = (logp - rng.uniform(-0.5, 0.5, (B, T))).astype(np.float32)
  adv = rng.normal(size=(B, T)).astype(np.float32)
  mask = (rng.uniform(size=(B, T)) < 0.7).astype(np.float32)
  mask[0, :2] = 0.0  # environment tokens
  return logp, sampler, ref, adv, mask


def test_group_advantages_hand_computed():
  rewards = jnp.asarray([1.0, 2.0, 0.0, 2.0, 0.0, 2.0, 1.0, 5.0])
  labels = np.asarray([7, 3, 7, 3, 7, 3, 7, 3])  # interleaved groups, arbitrary labels
  dr = pg.group_advantages(rewards, labels)
  # group 7: 1, 0, 0, 1 (mean 0.5); group 3: 2, 2, 2, 5 (mean 2.75)
  np.testing.assert_allclose(dr, [0.5, -0.75, -0.5, -0.75, -0.5, -0.75, 0.5, 2.25], atol=1e-6)
  same = pg.group_advantages(rewards, np.asarray([[1, 3, 5, 7], [0, 2, 4, 6]]))
  np.testing.assert_array_equal(same, dr)
  grpo = pg.group_advantages(rewards, labels, scale_by_std=True, eps=0.0)
  std_3 = np.sqrt((3 * 0.75 ** 2 + 2.25 ** 2) / 4)  # population std of group 3
  expected = np.asarray([1, -0.75 / std_3, -1, -0.75 / std_3, -1, -0.75 / std_3, 1, 2.25 / std_3])
  np.testing.assert_allclose(grpo, expected, rtol=1e-6)


def test_std_division_blows_up_near_equal_groups():
  # All four rollouts pass; one is 1e-3 better (e.g. a length bonus). Dr. GRPO keeps the
  # difference at 1e-3 scale, GRPO turns it into a full unit-scale signal.
  rewards = jnp.asarray([1.0, 1.0, 1.0, 1.001])
  dr = pg.group_advantages(rewards, np.zeros(4, int))
  grpo = pg.group_advantages(rewards, np.zeros(4, int), scale_by_std=True)
  np.testing.assert_allclose(dr, [-0.00025, -0.00025, -0.00025, 0.00075], atol=1e-6)
  r = np.asarray(rewards, np.float64)
  np.testing.assert_allclose(grpo, (r - r.mean()) / (r.std() + 1e-6), rtol=1e-3)
  assert float(grpo[3]) > 1.7  # ~sqrt(3): unit scale from a 1e-3 difference


def test_ragged_groups_raise():
  with pytest.raises(ValueError, match="ragged"):
    pg.group_advantages(jnp.zeros(5), np.asarray([0, 0, 0, 1, 1]))
  with pytest.raises(ValueError):
    pg.group_advantages(jnp.zeros(4), np.asarray([[0, 1], [1, 2]]))  # row 1 twice, row 3 never


def test_chain_broadcast_gives_every_segment_the_chain_advantage():
  chain_adv = jnp.asarray([0.5, -1.0])
  chain_of_row = jnp.asarray([0, 0, 1, 0])  # chain 0 was summarised twice: three segment rows
  mask = np.ones((4, 5), np.float32)
  mask[:, :2] = 0  # each segment opens with environment tokens (task / summary prompt)
  out = pg.token_advantages(chain_adv, jnp.asarray(mask), chain_of_row)
  expected = np.asarray([0.5, 0.5, -1.0, 0.5])[:, None] * mask
  np.testing.assert_array_equal(out, expected)
  np.testing.assert_array_equal(pg.token_advantages(jnp.asarray([1.0, 2.0, 3.0, 4.0]),
                                                    jnp.asarray(mask)),
                                np.arange(1, 5)[:, None] * mask)


def test_constant_normaliser():
  logp = jnp.full((2, 8), -1.0)
  adv = jnp.asarray([[1.0] * 8, [-0.5] * 8])
  short = np.zeros((2, 8), np.float32)
  short[0, :2], short[1, :4] = 1, 1
  long = short.copy()
  long[0, :4] = 1  # row 0 now has twice the masked tokens
  loss = lambda m, a=adv, lp=logp: pg.policy_gradient_loss(lp, lp, a, jnp.asarray(m),
                                                           normalizer=Z)[0]
  # Closed form: -sum(mask * A * logp) / Z, row by row.
  row0_short, row1 = 2 * 1.0 / Z, 4 * -0.5 / Z
  np.testing.assert_allclose(loss(short), row0_short + row1, rtol=1e-6)
  np.testing.assert_allclose(loss(long), 2 * row0_short + row1, rtol=1e-6)  # doubles, no 1/|o|
  # More tokens in the batch that carry no advantage (or padding rows) change nothing: no
  # division by the batch's token count.
  padded = np.concatenate([short, np.ones((1, 8), np.float32)])
  np.testing.assert_allclose(
      loss(padded, jnp.concatenate([adv, jnp.zeros((1, 8))]), jnp.full((3, 8), -1.0)),
      loss(short), rtol=1e-6)
  with pytest.raises(TypeError):
    pg.policy_gradient_loss(logp, logp, adv, jnp.asarray(short), normalizer=jnp.asarray(Z))


@pytest.mark.parametrize("is_cap", [None, 2.0])
def test_gradient_is_minus_mask_advantage_weight_over_z(is_cap):
  logp, sampler, _, adv, mask = map(jnp.asarray, _batch())
  grad = jax.grad(lambda lp: pg.policy_gradient_loss(lp, sampler, adv, mask, normalizer=Z,
                                                     is_cap=is_cap)[0])(logp)
  w = np.ones((B, T)) if is_cap is None else np.minimum(np.exp(logp - sampler), is_cap)
  if is_cap is not None:
    assert 0 < np.sum(np.exp(logp - sampler) > is_cap) < B * T  # the cap bites somewhere
  # A weight carrying gradient would add -mask * A * logp * dw/dlogp / Z here: it must not.
  np.testing.assert_allclose(grad, -mask * adv * w / Z, rtol=1e-5, atol=1e-8)
  assert np.all(np.asarray(grad)[np.asarray(mask) == 0] == 0)  # environment tokens
  value, _ = pg.policy_gradient_loss(logp, sampler, adv, mask, normalizer=Z, is_cap=is_cap)
  np.testing.assert_allclose(value, -np.sum(mask * w * adv * logp) / Z, rtol=1e-5)


def test_pg_mask_drops_tokens_from_the_policy_gradient_only():
  """pg_mask 0 removes a token from the policy-gradient term (its gradient there is the KL loss's
  alone); the metrics still count every model token."""
  logp, sampler, ref, adv, mask = map(jnp.asarray, _batch(2))
  keep = jnp.asarray(np.random.default_rng(5).random((B, T)) < 0.5, jnp.float32)
  beta = 0.1
  loss = lambda lp, placement: pg.policy_gradient_loss(
      lp, sampler, adv, mask, normalizer=Z, ref_logp=ref, kl_coef=beta, kl_placement=placement,
      pg_mask=keep)
  np.testing.assert_allclose(jax.grad(lambda lp: loss(lp, "loss")[0])(logp),
                             -mask * keep * adv / Z + beta * mask / Z, rtol=1e-5, atol=1e-8)
  value, metrics = loss(logp, "reward")
  shaped = adv - beta * (logp - ref)
  np.testing.assert_allclose(value, -np.sum(mask * keep * shaped * logp) / Z, rtol=1e-5)
  np.testing.assert_allclose(metrics["pg_token_fraction"], np.sum(mask * keep) / np.sum(mask),
                             rtol=1e-6)
  assert 0 < float(metrics["pg_token_fraction"]) < 1
  assert float(metrics["tokens"]) == float(np.sum(mask))


def test_kl_placements():
  logp, sampler, ref, adv, mask = map(jnp.asarray, _batch(1))
  beta = 0.3

  def grad_and_value(placement, **kw):
    f = lambda lp: pg.policy_gradient_loss(lp, sampler, adv, mask, normalizer=Z, ref_logp=ref,
                                           kl_coef=beta, kl_placement=placement, **kw)[0]
    return jax.grad(f)(logp), f(logp)

  base_grad, base_value = grad_and_value("none")
  np.testing.assert_allclose(base_grad, -mask * adv / Z, rtol=1e-5, atol=1e-8)
  k1 = np.asarray(logp - ref)
  # reward: A <- A - beta * sg(k1): the gradient moves by +beta * mask * k1 / Z per token.
  reward_grad, reward_value = grad_and_value("reward")
  np.testing.assert_allclose(reward_grad - base_grad, beta * mask * k1 / Z, rtol=1e-4, atol=1e-8)
  np.testing.assert_allclose(reward_value, -np.sum(mask * (adv - beta * k1) * logp) / Z,
                             rtol=1e-5)
  # ... and with truncated IS the shaping term is weighted like the advantage.
  capped_grad, _ = grad_and_value("reward", is_cap=2.0)
  w = np.minimum(np.exp(logp - sampler), 2.0)
  np.testing.assert_allclose(capped_grad, -mask * w * (adv - beta * k1) / Z, rtol=1e-4,
                             atol=1e-8)
  # loss: + beta * sum(mask * k1) / Z: the gradient moves by beta * mask / Z, the value by
  # exactly the KL term.
  loss_grad, loss_value = grad_and_value("loss")
  np.testing.assert_allclose(loss_grad - base_grad, beta * mask / Z, rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(loss_value - base_value, beta * np.sum(mask * k1) / Z, rtol=1e-4)
  with pytest.raises(ValueError):
    pg.policy_gradient_loss(logp, sampler, adv, mask, normalizer=Z, kl_coef=beta)  # no ref


def test_metrics_closed_form():
  logp, sampler, ref, adv, mask = _batch(2)
  _, m = jax.jit(lambda *a: pg.policy_gradient_loss(*a[:4], normalizer=Z, ref_logp=a[4],
                                                    kl_coef=0.1, is_cap=2.0))(
      logp, sampler, adv, mask, ref)
  keep = mask > 0
  gap = np.abs(logp - sampler)[keep]
  np.testing.assert_allclose(m["kl"], np.mean((logp - ref)[keep]), rtol=1e-5)
  np.testing.assert_allclose(m["mismatch_mean"], gap.mean(), rtol=1e-5)
  np.testing.assert_allclose(m["mismatch_p99"], np.percentile(gap, 99), rtol=1e-5)
  np.testing.assert_allclose(m["is_clipped_fraction"],
                             np.mean(np.exp(logp - sampler)[keep] > 2.0), rtol=1e-6)
  np.testing.assert_allclose(m["advantage_mean"], adv[keep].mean(), rtol=1e-5)
  assert float(m["tokens"]) == keep.sum()


def test_masked_percentile_matches_numpy():
  rng = np.random.default_rng(3)
  values = rng.normal(size=(5, 40)).astype(np.float32)
  for frac in (0.05, 0.5, 1.0):
    mask = rng.uniform(size=values.shape) < frac
    mask.flat[0] = True
    for q in (0.0, 50.0, 99.0, 100.0):
      np.testing.assert_allclose(pg.masked_percentile(jnp.asarray(values), jnp.asarray(mask), q),
                                 np.percentile(values[mask], q), rtol=1e-5, atol=1e-6)
  assert float(pg.masked_percentile(jnp.asarray(values), jnp.zeros(values.shape), 99.0)) == 0.0
