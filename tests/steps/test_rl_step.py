"""The RL objective and step: chunked token log-probs, the loss against a full-logits closed form,
router replay of the model's own routes, and the policy moving the way the advantages say."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from c2 import model
from c2.losses.lm import LossWeights
from c2.losses.rl import RLLossWeights, rl_loss, token_logprobs
from c2.steps.context import StepContext
from c2.steps.rl import rl_step
from c2.train.state import TrainState


@pytest.mark.parametrize("n, chunk", [(10, 4), (8, 8), (5, 16)])
def test_token_logprobs_equal_the_full_log_softmax_value_and_gradient(n, chunk):
  keys = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(keys[0], (n, 6))
  kernel = jax.random.normal(keys[1], (6, 11))
  targets = jax.random.randint(keys[2], (n,), 0, 11)
  full = lambda h, w: jnp.take_along_axis(jax.nn.log_softmax(h @ w), targets[:, None], -1)[:, 0]
  np.testing.assert_allclose(token_logprobs(hidden, kernel, targets, chunk), full(hidden, kernel),
                             rtol=1e-6, atol=1e-6)
  weights = jnp.arange(n, dtype=jnp.float32)
  g_chunked = jax.grad(lambda h, w: jnp.sum(weights * token_logprobs(h, w, targets, chunk)),
                       argnums=(0, 1))(hidden, kernel)
  g_full = jax.grad(lambda h, w: jnp.sum(weights * full(h, w)), argnums=(0, 1))(hidden, kernel)
  for a, b in zip(g_chunked, g_full):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_token_logprobs_of_active_tokens_only_skip_the_rest():
  """`active`: the active tokens' log-probs and gradients as without it, 0 elsewhere; the chunks
  holding no active token are not computed (NaN hidden states there never reach the output)."""
  n, chunk = 24, 4
  keys = jax.random.split(jax.random.key(1), 3)
  active = jnp.zeros(n, bool).at[jnp.array([1, 5, 6, 11, 17, 23, 2, 20])].set(True)  # 2 chunks
  hidden = jax.random.normal(keys[0], (n, 6))
  kernel = jax.random.normal(keys[1], (6, 11))
  targets = jax.random.randint(keys[2], (n,), 0, 11)
  weights = jnp.arange(n, dtype=jnp.float32)
  loss = lambda h, w, a: jnp.sum(weights * jnp.where(active, token_logprobs(h, w, targets, chunk,
                                                                            a), 0.0))
  value, grads = jax.value_and_grad(loss, argnums=(0, 1))(hidden, kernel, None)
  poisoned = jnp.where(active[:, None], hidden, jnp.nan)
  got_value, got_grads = jax.value_and_grad(loss, argnums=(0, 1))(poisoned, kernel, active)
  np.testing.assert_allclose(got_value, value, rtol=1e-6)
  for got, want in zip(got_grads, grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  logp = token_logprobs(hidden, kernel, targets, chunk, active)
  assert np.all(np.asarray(logp)[~np.asarray(active)] == 0)
  assert np.all(np.asarray(logp)[np.asarray(active)] < 0)


@pytest.mark.parametrize("use_active", [False, True])
def test_token_logprobs_entropy_equals_the_full_softmax_entropy(use_active):
  n, chunk = 12, 5
  keys = jax.random.split(jax.random.key(2), 3)
  hidden = 3.0 * jax.random.normal(keys[0], (n, 6))  # a spread of sharp and flat rows
  kernel = jax.random.normal(keys[1], (6, 11))
  targets = jax.random.randint(keys[2], (n,), 0, 11)
  active = jnp.arange(n) % 3 != 0 if use_active else None
  logp, entropy = token_logprobs(hidden, kernel, targets, chunk, active, with_entropy=True)
  log_probs = jax.nn.log_softmax(hidden @ kernel)
  want = -jnp.sum(jnp.exp(log_probs) * log_probs, -1)
  on = np.ones(n, bool) if active is None else np.asarray(active)
  np.testing.assert_allclose(np.asarray(entropy)[on], np.asarray(want)[on], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(logp, token_logprobs(hidden, kernel, targets, chunk, active),
                             rtol=1e-6)
  assert float(jnp.max(want)) > 1.0 and float(jnp.min(want)) < 0.5  # the rows differ
  if active is not None:
    assert np.all(np.asarray(entropy)[~on] == 0)


def _batch(cfg, rng):
  b, t = 2, 12
  keys = jax.random.split(rng, 3)
  tokens = jax.random.randint(keys[0], (b, t), 2, cfg.vocab_size)
  segment_ids = jnp.ones((b, t), jnp.int32).at[1, 9:].set(0)  # row 1 padded at the end
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  loss_mask = jnp.zeros((b, t)).at[:, 4:].set(1.0) * (segment_ids > 0)  # prompt: 4 tokens
  advantages = jnp.array([[0.7], [-0.4]]) * loss_mask
  sampler_logp = -jnp.abs(jax.random.normal(keys[1], (b, t)))
  return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions,
          "loss_mask": loss_mask, "advantages": advantages, "sampler_logp": sampler_logp}


def test_rl_loss_matches_the_closed_form_from_full_logits(small_cfg):
  params = model.init_params(small_cfg, jax.random.key(1))
  batch = _batch(small_cfg, jax.random.key(2))
  weights = RLLossWeights(normalizer=64.0, chunk_size=5)
  loss, aux = rl_loss(small_cfg, params, batch, weights)
  # Closed form: position t predicts token t + 1; model tokens from index 4 on, same segment.
  logits = model.logits(small_cfg, params, batch["tokens"], batch["segment_ids"],
                        batch["positions"])
  logp_all = jax.nn.log_softmax(logits.astype(jnp.float32))
  logp = jnp.take_along_axis(logp_all[:, :-1], batch["tokens"][:, 1:, None], -1)[..., 0]
  mask = batch["loss_mask"][:, 1:] * (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])
  expected = -jnp.sum(mask * batch["advantages"][:, 1:] * logp) / 64.0
  np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(aux["logp"][:, :-1] * mask, logp * mask, atol=1e-5)
  assert float(aux["metrics"]["rl/tokens"]) == float(mask.sum()) == 8 + 5

  # Replaying the model's own routes changes nothing and overrides nothing.
  routes = model.forward(small_cfg, params, batch["tokens"], batch["segment_ids"],
                         batch["positions"], with_mtp=False)["aux"]["moe"]["routes"]
  replayed, aux_r = rl_loss(small_cfg, params, {**batch, "forced_routes": routes}, weights)
  np.testing.assert_allclose(replayed, loss, rtol=1e-6, atol=1e-7)
  assert float(aux_r["metrics"]["rl/replay_override_rate"]) == 0.0


def test_min_entropy_trains_only_the_uncertain_positions(small_cfg):
  """RLLossWeights.min_entropy: the loss is the closed form over the model tokens whose
  next-token entropy reaches the threshold, and the others get no gradient."""
  params = model.init_params(small_cfg, jax.random.key(1))
  batch = _batch(small_cfg, jax.random.key(2))
  logits = model.logits(small_cfg, params, batch["tokens"], batch["segment_ids"],
                        batch["positions"])
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))[:, :-1]
  entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, -1)  # [B, T - 1]
  mask = batch["loss_mask"][:, 1:] * (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])
  # About half kept: midway between two neighbouring entropies, so rounding decides no token.
  sorted_entropy = np.sort(np.asarray(entropy)[np.asarray(mask) > 0])
  middle = len(sorted_entropy) // 2
  threshold = float(sorted_entropy[middle - 1] + sorted_entropy[middle]) / 2
  keep = mask * (entropy >= threshold)
  logp = jnp.take_along_axis(log_probs, batch["tokens"][:, 1:, None], -1)[..., 0]
  weights = RLLossWeights(normalizer=64.0, chunk_size=5, min_entropy=threshold)
  loss, aux = rl_loss(small_cfg, params, batch, weights)
  np.testing.assert_allclose(loss, -jnp.sum(keep * batch["advantages"][:, 1:] * logp) / 64.0,
                             rtol=1e-5, atol=1e-6)
  metrics = aux["metrics"]
  np.testing.assert_allclose(metrics["rl/pg_token_fraction"], keep.sum() / mask.sum(), rtol=1e-6)
  assert 0 < float(metrics["rl/pg_token_fraction"]) < 1
  np.testing.assert_allclose(metrics["rl/entropy_mean"], jnp.sum(entropy * mask) / mask.sum(),
                             rtol=1e-5)
  # Off (0), every model token counts, as before.
  off, _ = rl_loss(small_cfg, params, batch, RLLossWeights(normalizer=64.0, chunk_size=5))
  np.testing.assert_allclose(off, -jnp.sum(mask * batch["advantages"][:, 1:] * logp) / 64.0,
                             rtol=1e-5, atol=1e-6)


def test_rl_steps_raise_the_logp_of_positive_advantages(small_cfg):
  batch = _batch(small_cfg, jax.random.key(3))
  tx = optax.adam(3e-3)
  params = model.init_params(small_cfg, jax.random.key(4))
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  weights = RLLossWeights(normalizer=24.0, chunk_size=8)
  ctx = StepContext(model=small_cfg, tx=tx, loss_weights=LossWeights(), rl=weights)
  step = jax.jit(lambda s, b: rl_step(s, b, ctx=ctx))
  logp = lambda p: rl_loss(small_cfg, p, batch, weights)[1]["logp"]
  before = logp(state.params)
  for _ in range(5):
    state, metrics = step(state, batch)
  after = logp(state.params)
  assert int(state.step) == 5 and np.isfinite(float(metrics["loss"]))
  assert float(metrics["grad_norm"]) > 0
  # Row 0 (advantage +0.7) became more likely, row 1 (-0.4) less, on its model tokens.
  sl = slice(3, 11)
  assert float(jnp.mean(after[0, sl] - before[0, sl])) > 0.05
  assert float(jnp.mean(after[1, 3:8] - before[1, 3:8])) < -0.02


def test_rl_step_without_rl_weights_says_so(small_cfg):
  ctx = StepContext(model=small_cfg, tx=optax.sgd(0.1), loss_weights=LossWeights())
  with pytest.raises(ValueError, match="StepContext.rl"):
    rl_step(None, {}, ctx=ctx)
