"""Router replay with the plausibility fallback: the rule's closed form, exact replay of the
router's own choices, fallback exactly where a replayed expert is implausible, gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2 import model
from c2.model.router import NOT_RECORDED, replay_threshold, route

N, D, E, K = 32, 16, 8, 2
ARGS = dict(top_k=K, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827)


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(D, E)) / np.sqrt(D), jnp.float32)
  bias = jnp.asarray(rng.normal(size=E) * 0.05, jnp.float32)
  return x, kernel, bias


def _selection(x, kernel, bias):
  return 1 / (1 + np.exp(-(np.asarray(x) @ np.asarray(kernel)))) + np.asarray(bias)  # [N, E]


def _distinct_random_routes(seed, n=N):
  rng = np.random.default_rng(seed)
  return np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int32)  # [N, K]


@pytest.mark.parametrize("rule", ["rank", "rank:0", "rank:3", 0.0, 0.05])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_replaying_own_choice_is_exact_under_every_rule(rule, groups):
  x, kernel, bias = _inputs()
  args = dict(ARGS, n_group=groups[0], topk_group=groups[1])
  own = route(x, kernel, bias, **args)
  replay = route(x, kernel, bias, **args, forced_expert_ids=own.expert_ids, replay_fallback=rule)
  assert not np.any(replay.overridden)
  np.testing.assert_array_equal(replay.expert_ids, own.expert_ids)
  np.testing.assert_array_equal(replay.weights, own.weights)


@pytest.mark.parametrize("rule,slack,margin", [("rank", K, None), ("rank:1", 1, None),
                                               (0.02, None, 0.02)])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_override_mask_matches_the_closed_form_rule(rule, slack, margin, groups):
  x, kernel, bias = _inputs(1)
  n_group, topk_group = groups
  forced = _distinct_random_routes(2)
  out = route(x, kernel, bias, **dict(ARGS, n_group=n_group, topk_group=topk_group),
              forced_expert_ids=jnp.asarray(forced), replay_fallback=rule)
  sel = _selection(x, kernel, bias)
  eligible = sel.copy()
  if n_group > 1:  # the router's own candidates: the topk_group groups by their top-2 sum
    grouped = sel.reshape(N, n_group, E // n_group)
    group_score = np.sort(grouped, -1)[..., -2:].sum(-1)
    dropped_groups = np.argsort(-group_score, -1)[:, topk_group:]
    for n in range(N):
      for g in dropped_groups[n]:
        eligible[n, g * (E // n_group):(g + 1) * (E // n_group)] = -np.inf
  ranked = -np.sort(-eligible, -1)
  threshold = ranked[:, K + slack - 1] if margin is None else ranked[:, K - 1] - margin
  np.testing.assert_allclose(replay_threshold(jnp.asarray(eligible, jnp.float32), K, rule),
                             threshold, rtol=1e-6)
  # Judged by the unmasked selection score against the threshold from the router's own top-k.
  expected = np.take_along_axis(sel, forced, -1) < threshold[:, None]
  assert 0 < expected.sum() < expected.size  # both outcomes occur: the test can fail
  np.testing.assert_array_equal(out.overridden, expected)
  ids = np.asarray(out.expert_ids)
  np.testing.assert_array_equal(ids[~expected], forced[~expected])
  assert all(len(set(row)) == K for row in ids.tolist())  # fills never duplicate a kept expert


def test_fallback_fills_with_own_best_not_already_kept():
  x, kernel, bias = _inputs(3)
  own = np.asarray(route(x, kernel, bias, **ARGS).expert_ids)  # [N, K] best first
  worst = np.argmin(_selection(x, kernel, bias), -1)  # rank E > 2K: implausible under "rank"
  cases = {
      "slot 1 dropped": (np.stack([own[:, 0], worst], 1), own),
      "slot 0 dropped": (np.stack([worst, own[:, 1]], 1), own),
      # The kept replayed id is the router's best: the fill skips it and takes its second best.
      "own best kept in slot 1": (np.stack([worst, own[:, 0]], 1),
                                  np.stack([own[:, 1], own[:, 0]], 1)),
  }
  for name, (forced, expected) in cases.items():
    out = route(x, kernel, bias, **ARGS, forced_expert_ids=jnp.asarray(forced),
                replay_fallback="rank")
    np.testing.assert_array_equal(out.expert_ids, expected, err_msg=name)
    assert int(out.overridden.sum()) == N, name
  off = route(x, kernel, bias, **ARGS,
              forced_expert_ids=jnp.asarray(np.stack([own[:, 0], worst], 1)), replay_fallback="off")
  np.testing.assert_array_equal(off.expert_ids[:, 1], worst)  # off: the implausible id is used
  assert not np.any(off.overridden)


def test_not_recorded_rows_route_themselves_and_are_never_overridden():
  x, kernel, bias = _inputs(4)
  own = route(x, kernel, bias, **ARGS)
  worst = np.argmin(_selection(x, kernel, bias), -1)
  forced = np.stack([worst, worst], 1)
  forced[::2] = NOT_RECORDED
  out = route(x, kernel, bias, **ARGS, forced_expert_ids=jnp.asarray(forced), replay_fallback="off")
  np.testing.assert_array_equal(out.expert_ids[::2], own.expert_ids[::2])
  np.testing.assert_array_equal(out.expert_ids[1::2], forced[1::2])
  on = route(x, kernel, bias, **ARGS, forced_expert_ids=jnp.asarray(forced), replay_fallback="rank")
  assert not np.any(on.overridden[::2]) and np.all(on.overridden[1::2])


def test_invalid_rules_raise():
  x, kernel, bias = _inputs()
  for rule in ("top", "rank:x", -0.1, True):
    with pytest.raises(ValueError):
      route(x, kernel, bias, **ARGS, forced_expert_ids=jnp.zeros((N, K), jnp.int32),
            replay_fallback=rule)


# --------------------------------------------------------------------------- through the model


@pytest.fixture(scope="module")
def setup(small_cfg):
  assert small_cfg.num_moe_layers == 1  # the MoE block is the last layer: see the position test
  params = model.init_params(small_cfg, jax.random.key(0))
  # Expert 0 becomes the lowest-scoring expert for every token (selection score < 1 - 10): the
  # bias shifts selection only, so the unforced forward never picks it and its output is unchanged.
  moe = params["moe_layers"]["block"]["moe"]
  moe["correction_bias"] = moe["correction_bias"].at[:, 0].set(-10.0)
  fwd = jax.jit(lambda p, t, r, rule: model.forward(small_cfg, p, t, forced_routes=r,
                                                      with_mtp=False, replay_fallback=rule),
                static_argnums=3)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, small_cfg.vocab_size, (2, 12)),
                       jnp.int32)
  return params, fwd, tokens


def test_model_replay_of_own_routes_is_exact(setup):
  params, fwd, tokens = setup
  free = fwd(params, tokens, None, "rank")
  replay = fwd(params, tokens, free["aux"]["moe"]["routes"], "rank")
  np.testing.assert_array_equal(replay["aux"]["moe"]["routes"], free["aux"]["moe"]["routes"])
  np.testing.assert_allclose(replay["hidden"], free["hidden"], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(replay["aux"]["moe"]["replay_override_rate"], [0.0])
  np.testing.assert_array_equal(free["aux"]["moe"]["replay_override_rate"], [0.0])


def test_model_falls_back_exactly_at_implausible_entries(setup, small_cfg):
  params, fwd, tokens = setup
  free = fwd(params, tokens, None, "rank")
  routes = np.asarray(free["aux"]["moe"]["routes"])  # [L, B, T, K]
  assert not np.any(routes == 0)
  chosen = [(0, 3), (0, 7), (1, 0), (1, 11)]  # (row, position) whose slot 1 replays expert 0
  forced = routes.copy()
  for b, t in chosen:
    forced[0, b, t, 1] = 0
  forced = jnp.asarray(forced)
  on = fwd(params, tokens, forced, "rank")
  entries = tokens.size * small_cfg.experts_per_token
  np.testing.assert_allclose(on["aux"]["moe"]["replay_override_rate"], [len(chosen) / entries])
  np.testing.assert_array_equal(on["aux"]["moe"]["routes"], routes)  # the router's own choice
  np.testing.assert_allclose(on["hidden"], free["hidden"], rtol=1e-6, atol=1e-6)
  # Off: expert 0 is used at exactly the chosen tokens, which then differ from the free forward.
  off = fwd(params, tokens, forced, "off")
  np.testing.assert_array_equal(off["aux"]["moe"]["routes"], forced)
  np.testing.assert_array_equal(off["aux"]["moe"]["replay_override_rate"], [0.0])
  diff = np.abs(np.asarray(off["hidden"] - free["hidden"])).max(-1)  # [B, T]
  changed = np.zeros(diff.shape, bool)
  changed[tuple(zip(*chosen))] = True
  assert np.all(diff[changed] > 1e-4) and np.all(diff[~changed] < 1e-6)


def test_model_not_recorded_rows_route_themselves(setup):
  params, fwd, tokens = setup
  free = fwd(params, tokens, None, "rank")
  unrecorded = jnp.full(free["aux"]["moe"]["routes"].shape, NOT_RECORDED, jnp.int32)
  out = fwd(params, tokens, unrecorded, "rank")
  np.testing.assert_array_equal(out["aux"]["moe"]["routes"], free["aux"]["moe"]["routes"])
  np.testing.assert_array_equal(out["aux"]["moe"]["replay_override_rate"], [0.0])


def test_gradients_reach_the_router_under_replay(setup):
  params, fwd, tokens = setup
  routes = fwd(params, tokens, None, "rank")["aux"]["moe"]["routes"]
  forced = routes.at[0, 0, :6, 1].set(0)  # some entries fall back, the rest replay

  def loss(p):
    return jnp.sum(fwd(p, tokens, forced, "rank")["hidden"] ** 2)

  grads = jax.grad(loss)(params)["moe_layers"]["block"]["moe"]
  assert float(jnp.abs(grads["router"]).sum()) > 0.0
  assert float(jnp.abs(grads["correction_bias"]).sum()) == 0.0  # moved by its own rule only
