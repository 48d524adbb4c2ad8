"""Tests for c2/optim/muon.py: Newton-Schulz band, batching over stacked matrices, update scale."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2.optim import muon


# Compiled once per shape; eager op-by-op dispatch would dominate these tests' runtime.
_orthogonalised = jax.jit(muon.orthogonalised_update, static_argnums=1)


def _singular_values(x):
  return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32 + 8)])
def test_newton_schulz_singular_values_in_quintic_band(shape):
  # Random Gaussian matrices are well conditioned when not square; 5 quintic steps then land
  # every singular value in the iteration's known band (~0.68 to ~1.13), not exactly at 1.
  matrix = jax.random.normal(jax.random.PRNGKey(0), shape) * 3.0
  ortho = jax.jit(muon.newton_schulz)(matrix)
  values = _singular_values(ortho)
  assert values.min() > 0.6 and values.max() < 1.25, (values.min(), values.max())
  # The singular vectors are kept: NS(M) points the same way as the exact U V^T.
  u, _, vt = np.linalg.svd(np.asarray(matrix, np.float64), full_matrices=False)
  exact = u @ vt
  cosine = np.sum(exact * np.asarray(ortho)) / (np.linalg.norm(exact) * np.linalg.norm(ortho))
  assert cosine > 0.97


def test_update_rms_matches_adamw_scale():
  matrix = jax.random.normal(jax.random.PRNGKey(1), (24, 96))
  update = _orthogonalised(matrix)
  rms = float(jnp.sqrt(jnp.mean(update**2)))
  # Exact orthogonalisation gives RMS 0.2; the quintic band allows roughly 0.7x to 1.2x.
  assert 0.2 * 0.7 < rms < 0.2 * 1.2


def test_stacked_layers_and_experts_are_orthogonalised_one_by_one():
  stacked = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (2, 3, 8, 12)))  # [L,E,D,F]
  update = _orthogonalised(stacked)
  for layer in range(2):
    for expert in range(3):
      np.testing.assert_allclose(update[layer, expert],
                                 _orthogonalised(stacked[layer, expert]),
                                 rtol=1e-5, atol=1e-6)


def test_custom_axes_orthogonalise_each_head():
  weight = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (16, 4, 8)))  # [D,H,K]
  per_head = _orthogonalised(weight, muon.MatrixAxes(rows=(0,), cols=(2,)))
  for head in range(4):
    np.testing.assert_allclose(per_head[:, head], _orthogonalised(weight[:, head]),
                               rtol=1e-5, atol=1e-6)
  fused = _orthogonalised(weight, muon.MatrixAxes(rows=(0,), cols=(1, 2)))
  np.testing.assert_allclose(fused.reshape(16, 32), _orthogonalised(weight.reshape(16, 32)),
                             rtol=1e-5, atol=1e-6)
  scale = 0.2 * math.sqrt(32)
  values = _singular_values(fused.reshape(16, 32) / scale)
  assert values.min() > 0.6 and values.max() < 1.25


def test_momentum_and_nesterov():
  grads = {"w": jnp.eye(4)[:3]}  # already orthogonal rows: NS leaves the direction unchanged
  tx = muon.scale_by_muon(momentum=0.5, nesterov=False)
  state = tx.init(grads)
  _, state = tx.update(grads, state)
  _, state = tx.update(grads, state)
  np.testing.assert_allclose(state.momentum["w"], 1.5 * grads["w"])
  assert state.momentum["w"].dtype == jnp.float32
  update, _ = muon.scale_by_muon(momentum=0.5, nesterov=True).update(
      grads, muon.MuonState(momentum={"w": -2 * grads["w"]}))
  # Nesterov: G + mu * (mu * M + G) = G + 0.5 * 0 = G. G's singular values are all equal, so NS
  # keeps its direction and only moves the common value into the band (1/sqrt(3) -> ~0.69).
  ratio = update["w"][0, 0] / (0.2 * math.sqrt(4))
  np.testing.assert_allclose(update["w"], ratio * 0.4 * grads["w"], atol=1e-6)
  assert 0.6 < ratio < 1.25
