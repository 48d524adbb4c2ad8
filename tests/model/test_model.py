"""Model semantics that hold for any weights: causality, packing isolation, MTP offsets, replay."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2 import model


@pytest.fixture(scope="module")
def setup(small_cfg):
  params = model.init_params(small_cfg, jax.random.key(0))
  fwd = jax.jit(lambda p, t, s, q, r: model.forward(small_cfg, p, t, s, q, r))
  return params, fwd


def _batch(cfg, seed=0, t=16):
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
  return tokens, jnp.ones((2, t), jnp.int32), jnp.broadcast_to(jnp.arange(t), (2, t))


def test_causal_and_mtp_offsets(small_cfg, setup):
  """Main hidden at t depends on tokens <= t; MTP depth 1 at t also sees token t + 1, not t + 2."""
  params, fwd = setup
  tokens, seg, pos = _batch(small_cfg)
  base = fwd(params, tokens, seg, pos, None)
  changed = fwd(params, tokens.at[:, 9].set((tokens[:, 9] + 1) % small_cfg.vocab_size), seg, pos, None)
  diff = np.abs(np.asarray(changed["hidden"] - base["hidden"])).max(axis=(0, 2))
  assert np.all(diff[:9] == 0) and np.all(diff[9:] > 0)
  mtp_diff = np.abs(np.asarray(changed["mtp_hidden"][0] - base["mtp_hidden"][0])).max(axis=(0, 2))
  assert np.all(mtp_diff[:8] == 0) and mtp_diff[8] > 0  # position 8 embeds token 9


def test_packed_documents_do_not_see_each_other(small_cfg, setup):
  params, fwd = setup
  tokens, _, _ = _batch(small_cfg)
  seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 6], 2, 0), jnp.int32)
  pos = jnp.asarray(np.repeat([list(range(10)) + list(range(6))], 2, 0), jnp.int32)
  packed = fwd(params, tokens, seg, pos, None)["hidden"]
  alone = fwd(params, tokens[:, 10:], jnp.ones((2, 6), jnp.int32),
              jnp.broadcast_to(jnp.arange(6), (2, 6)), None)["hidden"]
  # MoE routing is per token, attention is masked, positions restart: identical up to float error.
  np.testing.assert_allclose(packed[:, 10:], alone, rtol=1e-5, atol=1e-5)


def test_router_replay_reproduces_routes_and_output(small_cfg, setup):
  params, fwd = setup
  tokens, seg, pos = _batch(small_cfg, seed=1)
  first = fwd(params, tokens, seg, pos, None)
  routes = first["aux"]["moe"]["routes"]  # [L, B, T, K]
  # Shift the correction bias hard: free routing changes, replayed routing must not.
  shifted = jax.tree.map(lambda a: a, params)
  bias = shifted["moe_layers"]["block"]["moe"]["correction_bias"]
  shifted["moe_layers"]["block"]["moe"]["correction_bias"] = bias.at[..., 0].set(5.0)
  free = fwd(shifted, tokens, seg, pos, None)
  replay = fwd(shifted, tokens, seg, pos, routes)
  assert not np.array_equal(free["aux"]["moe"]["routes"], routes)
  np.testing.assert_array_equal(replay["aux"]["moe"]["routes"], routes)
  np.testing.assert_allclose(replay["hidden"], first["hidden"], rtol=1e-6, atol=1e-6)


def test_logits_entry_point_and_bf16(small_cfg):
  params = model.init_params(small_cfg, jax.random.key(1))
  tokens, _, _ = _batch(small_cfg, t=8)
  logits = model.logits(small_cfg, params, tokens)
  assert logits.shape == (2, 8, small_cfg.vocab_size) and logits.dtype == jnp.float32
  bf16 = model.logits(small_cfg.replace(dtype="bfloat16"), params, tokens)
  assert bf16.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(bf16)))
  # bf16 compute tracks float32 (loose: ~3 significant digits through 2 layers).
  assert float(jnp.max(jnp.abs(bf16 - logits))) < 0.1 * float(jnp.max(jnp.abs(logits)))
  mtp = model.mtp_logits(small_cfg, params, tokens)
  assert mtp.shape == (1, 2, 8, small_cfg.vocab_size)


def test_config_validation_names_the_field(small_cfg):
  with pytest.raises(ValueError, match="experts_per_token"):
    small_cfg.replace(experts_per_token=99)
  with pytest.raises(ValueError, match="gmm_impl"):
    small_cfg.replace(gmm_impl="fast")
  with pytest.raises(ValueError, match="qk_rope_head_dim"):
    small_cfg.replace(qk_rope_head_dim=7)
  with pytest.raises(ValueError, match="splash_query_chunks"):
    small_cfg.replace(splash_query_chunks=0)


def test_router_biases_move_by_the_aux_free_rule_through_the_model_api(small_cfg, setup):
  """The model owns where its routers' biases live: loads from a forward pass, keyed by router
  group, move exactly those biases by rate * sign(mean - load); nothing else changes."""
  params, fwd = setup
  out = fwd(params, *_batch(small_cfg), None)
  loads = model.router_loads(out["aux"])
  e = small_cfg.num_routed_experts
  assert loads["trunk"].shape == (small_cfg.num_moe_layers, e)
  assert loads["mtp"].shape == (small_cfg.mtp_depth, e)
  before = model.router_biases(params)
  moved = model.update_router_biases(params, loads, rate=0.01)
  after = model.router_biases(moved)
  for group in ("trunk", "mtp"):
    load = np.asarray(loads[group])
    want = np.asarray(before[group]) + 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(after[group], want, rtol=0, atol=1e-7)
    assert np.any(np.asarray(after[group]) != np.asarray(before[group]))
  np.testing.assert_array_equal(moved["mtp_0"]["block"]["moe"]["correction_bias"], after["mtp"][0])
  unchanged = [(k, a, b) for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                                              jax.tree.leaves(moved))
               if model.ROUTER_BIAS not in jax.tree_util.keystr(k)]
  assert all(np.array_equal(a, b) for _, a, b in unchanged)
  assert model.update_router_biases(params, loads, rate=0.0) is params
