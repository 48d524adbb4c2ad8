"""YaRN frequencies and scales against the worked values of algorithms.md section 5.2."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from c2.model.config import YarnScaling, get_preset
from c2.model.rope import apply_rotary, inverse_frequencies, rotary_angles


def _plain(theta, dim=64):
  return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


@pytest.mark.parametrize("theta,scaling,kept_until,interp_from", [
    # Kimi-K2.5: low 8, high 20 -> pairs 0..8 kept, 20..31 interpolated, 9..19 blended.
    (50000.0, YarnScaling(64.0, 4096, beta_fast=32.0, beta_slow=1.0), 8, 20),
    # Kimi-K2-Instruct: beta_fast = beta_slow = 1 -> a hard cut at 19/20.
    (50000.0, YarnScaling(32.0, 4096, beta_fast=1.0, beta_slow=1.0), 19, 20),
    # DeepSeek-V3: base 10000, factor 40 -> low 10, high 23.
    (10000.0, YarnScaling(40.0, 4096, beta_fast=32.0, beta_slow=1.0), 10, 23),
])
def test_yarn_ramp_matches_worked_values(theta, scaling, kept_until, interp_from):
  inv_freq, multiplier = inverse_frequencies(64, theta, scaling)
  plain = _plain(theta)
  np.testing.assert_allclose(inv_freq[:kept_until + 1], plain[:kept_until + 1], rtol=1e-6)
  np.testing.assert_allclose(inv_freq[interp_from:], plain[interp_from:] / scaling.factor, rtol=1e-6)
  blended = inv_freq[kept_until + 1:interp_from]
  assert np.all(blended < plain[kept_until + 1:interp_from])
  assert np.all(blended > plain[kept_until + 1:interp_from] / scaling.factor)
  assert multiplier == 1.0  # mscale == mscale_all_dim


def test_softmax_scale_folds_mscale_squared():
  # 192^-1/2 * (0.1 ln 64 + 1)^2 = 0.144680 (K2.5); 0.130861 for K2 (factor 32).
  assert get_preset("kimi-k2.5").softmax_scale == pytest.approx(0.144680, abs=1e-6)
  assert get_preset("kimi-k2").softmax_scale == pytest.approx(0.130861, abs=1e-6)
  no_yarn = get_preset("kimi-k2.5", rope_scaling=None)
  assert no_yarn.softmax_scale == pytest.approx(192 ** -0.5)


def test_rotary_scores_depend_only_on_relative_position():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 16)), jnp.float32)
  scaling = YarnScaling(64.0, 4096)

  def score(pq, pk):
    cq, sq = rotary_angles(jnp.array([[pq]]), 16, 50000.0, scaling)
    ck, sk = rotary_angles(jnp.array([[pk]]), 16, 50000.0, scaling)
    return float(jnp.sum(apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)))

  assert score(7, 3) == pytest.approx(score(107, 103), rel=1e-4)
  assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)


def test_rotation_is_interleaved_pairs():
  """Pair (x[0], x[1]) rotates by angle pos * inv_freq[0]; output is de-interleaved."""
  x = jnp.array([[[1.0, 0.0, 0.0, 1.0]]])
  cos, sin = rotary_angles(jnp.array([[1]]), 4, 10000.0, None)
  out = np.asarray(apply_rotary(x, cos, sin))[0, 0]
  a0, a1 = 1.0, 1.0 / 100.0  # inv_freq = 10000^-(0/4), 10000^-(2/4)
  # evens' = [x0 cos a0 - x1 sin a0, x2 cos a1 - x3 sin a1]; odds' = [x1 cos + x0 sin, ...]
  expected = [math.cos(a0), -math.sin(a1), math.sin(a0), math.cos(a1)]
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
