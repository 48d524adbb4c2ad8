"""Sampling distributions against numpy closed forms, and the speculative acceptance rule against
the distribution it must reproduce (chi-square over 20,000 draws on a 6-token vocabulary)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from c2.infer import sampling, speculative


def reference_dist(logits, temperature, top_k, top_p):
  """numpy: temperature, then top-k, then the smallest top-p prefix of what is left."""
  if temperature == 0:
    out = np.full_like(logits, -np.inf)
    out[np.argmax(logits)] = 0.0
    return out
  z = logits / temperature
  order = np.argsort(-z)
  keep = np.zeros(len(z), bool)
  keep[order[:top_k or len(z)]] = True
  p = np.exp(z - z.max()) * keep
  p /= p.sum()
  mass = 0.0
  final = np.zeros(len(z), bool)
  for i in order:
    if keep[i] and mass < top_p:
      final[i] = True
      mass += p[i]
  q = np.where(final, np.exp(z - z.max()), 0.0)
  with np.errstate(divide="ignore"):
    return np.log(q / q.sum())


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.6), (0.9, 4, 0.8), (0.0, 0, 1.0)])
def test_sampling_logprobs_closed_form(temperature, top_k, top_p):
  logits = np.random.RandomState(0).randn(4, 10).astype(np.float32) * 2
  got = sampling.sampling_logprobs(jnp.asarray(logits), jnp.full(4, temperature),
                                   jnp.full(4, top_k, jnp.int32), jnp.full(4, top_p))
  for row in range(4):
    np.testing.assert_allclose(got[row], reference_dist(logits[row], temperature, top_k, top_p),
                               atol=1e-6)


def test_argmax_takes_the_first_maximum_like_numpy():
  rng = np.random.RandomState(2)
  values = rng.randint(0, 4, (64, 33)).astype(np.float32)  # small range: ties in every row
  values[3] = -np.inf
  values[4, 5] = np.inf
  got = np.asarray(sampling.argmax(jnp.asarray(values)))
  np.testing.assert_array_equal(got, np.argmax(values, axis=-1))
  assert got.dtype == np.int32


def test_rows_keep_their_own_settings_and_greedy_reports_model_logprobs():
  logits = jnp.asarray(np.random.RandomState(1).randn(2, 8).astype(np.float32))
  temperature = jnp.array([0.0, 1.0])
  dist = sampling.sampling_logprobs(logits, temperature, jnp.array([0, 2]), jnp.array([1.0, 1.0]))
  assert np.isfinite(np.asarray(dist[0])).sum() == 1 and np.isfinite(np.asarray(dist[1])).sum() == 2
  reported = sampling.reported_logprobs(logits, dist, temperature)
  np.testing.assert_allclose(reported[0], jax.nn.log_softmax(logits[0]), atol=1e-6)


def test_seeds_outside_the_uint32_range_are_refused_by_name():
  sampling.SamplingParams(seed=2**32 - 1)  # the largest key the engine can pack
  for bad in (2**32, -1):
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32\)"):
      sampling.SamplingParams(seed=bad)


def test_draws_follow_the_distribution_and_depend_only_on_seed_and_position():
  logp = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
  n = 20000
  keys = sampling.row_keys(jnp.arange(n), jnp.full(n, 7), sampling.SAMPLE)
  tokens = np.asarray(sampling.draw(jnp.broadcast_to(logp, (n, 4)), keys))
  assert chisquare_p(np.bincount(tokens, minlength=4), np.exp(np.asarray(logp))) > 1e-3
  again = sampling.draw(jnp.broadcast_to(logp, (3, 4)), sampling.row_keys(
      jnp.arange(3), jnp.full(3, 7), sampling.SAMPLE))
  np.testing.assert_array_equal(again, tokens[:3])


def test_draws_never_take_a_zero_probability_token_and_match_the_distribution():
  """V = 50 (blocks of 8, the last one partial): zero mass on the first token, on a whole block
  and on the last tokens; the rest drawn in proportion."""
  probs = np.random.default_rng(0).random(50)
  probs[[0, 8, 9, 10, 11, 12, 13, 14, 15, 47, 48, 49]] = 0
  probs /= probs.sum()
  n = 40000
  tokens = np.asarray(sampling.draw(jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)),
                                                     (n, 50)),
                                    sampling.row_keys(jnp.arange(n), jnp.full(n, 3),
                                                      sampling.SAMPLE)))
  counts = np.bincount(tokens, minlength=50)
  assert counts[probs == 0].sum() == 0
  assert chisquare_p(counts[probs > 0], probs[probs > 0]) > 1e-3
  # A point mass (greedy rows' distribution) always gives its token, wherever it sits.
  for token in (0, 7, 49):
    point = jnp.where(jnp.arange(50) == token, 0.0, -jnp.inf)[None].repeat(4, 0)
    assert np.all(np.asarray(sampling.draw(point, sampling.row_keys(
        jnp.arange(4), jnp.zeros(4, jnp.int32), sampling.SAMPLE))) == token)


def chisquare_p(counts, probs):
  """p-value of counts against probabilities (renormalised in float64: scipy wants equal sums)."""
  probs = np.asarray(probs, np.float64)
  return stats.chisquare(counts, counts.sum() * probs / probs.sum()).pvalue


def _random_dist(key, shape, sharpness=1.5):
  return jax.nn.log_softmax(sharpness * jax.random.normal(key, shape), -1)


def test_speculative_acceptance_reproduces_target_distribution():
  n, d, v = 20000, 2, 6
  target = _random_dist(jax.random.key(0), (d + 1, v))
  draft = _random_dist(jax.random.key(1), (d, v))
  seeds = jnp.arange(n)
  drafts = jnp.stack([sampling.draw(jnp.broadcast_to(draft[j], (n, v)), sampling.row_keys(
      seeds, jnp.full(n, 1 + j), sampling.DRAFT)) for j in range(d)], 1)
  accepted, tokens = speculative.accept(jnp.broadcast_to(target, (n, d + 1, v)),
                                        jnp.broadcast_to(draft, (n, d, v)), drafts, seeds,
                                        jnp.ones(n, jnp.int32))
  accepted, tokens = np.asarray(accepted), np.asarray(tokens)
  p = np.exp(np.asarray(target))
  # First emitted token ~ p_1; second (when the first draft was accepted) ~ p_2.
  first = np.bincount(tokens[:, 0], minlength=v)
  assert chisquare_p(first, p[0]) > 1e-3
  second = np.bincount(tokens[accepted >= 1, 1], minlength=v)
  assert chisquare_p(second, p[1]) > 1e-3
  # The acceptance rate of draft 1 is sum min(p, q), its closed form.
  q = np.exp(np.asarray(draft))
  assert abs((accepted >= 1).mean() - np.minimum(p[0], q[0]).sum()) < 0.015
  # A sampler that ignores the rule (always accepting) is caught by the same test.
  assert chisquare_p(np.bincount(np.asarray(drafts[:, 0]), minlength=v), p[0]) < 1e-3


def test_greedy_acceptance_is_argmax_agreement():
  target = jnp.log(jnp.array([[[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]],
                              [[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]]]))
  point = lambda i: jnp.where(jnp.arange(3) == i, 0.0, -jnp.inf)
  target_greedy = jnp.stack([jnp.stack([point(1), point(0)])] * 2)
  draft = jnp.stack([point(1)[None], point(2)[None]])
  accepted, tokens = speculative.accept(target_greedy, draft, jnp.array([[1], [2]]),
                                        jnp.arange(2), jnp.ones(2, jnp.int32))
  np.testing.assert_array_equal(accepted, [1, 0])
  np.testing.assert_array_equal(tokens[0], [1, 0])  # draft accepted, bonus = argmax p_2
  assert int(tokens[1, 0]) == 1  # rejected: the correction is argmax p_1
  del target
