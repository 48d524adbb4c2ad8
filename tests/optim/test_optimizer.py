"""Tests for c2/optim/: schedules in closed form, path rules, clipping, freezing, convergence."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from c2 import optim
from c2.optim.muon import MatrixAxes, orthogonalised_update


def _toy_params():
  return {
      "embed": {"embedding": jnp.ones((10, 4))},
      "layers": {
          "attn": {"q_proj": {"kernel": jnp.ones((2, 4, 4)), "bias": jnp.ones((2, 4))}},
          "attn_norm": {"scale": jnp.ones((2, 4))},
          "moe": {"experts": {"w_up": jnp.ones((2, 3, 4, 8))},
                  "router": {"kernel": jnp.ones((2, 4, 3)),
                             "e_score_correction_bias": jnp.zeros((2, 3))}},
      },
      "final_norm": {"scale": jnp.ones((4,))},
      "lm_head": {"kernel": jnp.ones((4, 10))},
  }


def _by_path(tree):
  return {optim.path_string(kp): leaf for kp, leaf in jax.tree_util.tree_leaves_with_path(tree)}


# ------------------------------------------------------------------------------ schedules


@pytest.mark.parametrize("shape,mid_decay", [("linear", 0.55), ("cosine", 0.55),
                                             ("sqrt", 1.0 - 0.9 * math.sqrt(0.5))])
def test_wsd_schedule_key_steps(shape, mid_decay):
  lr = optim.wsd_schedule(peak_lr=1.0, total_steps=100, warmup_steps=10, decay_fraction=0.2,
                          decay_shape=shape, final_lr=0.1)
  expected = {0: 0.0, 5: 0.5, 10: 1.0, 50: 1.0, 80: 1.0, 90: mid_decay, 100: 0.1, 150: 0.1}
  for step, value in expected.items():
    np.testing.assert_allclose(lr(step), value, rtol=1e-6, atol=1e-7, err_msg=f"step {step}")


def test_cosine_schedule_key_steps():
  lr = optim.cosine_schedule(peak_lr=2.0, total_steps=110, warmup_steps=10, final_lr=0.2)
  expected = {0: 0.0, 5: 1.0, 10: 2.0, 60: 1.1, 110: 0.2, 200: 0.2,
              35: 0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi / 4))}
  for step, value in expected.items():
    np.testing.assert_allclose(lr(step), value, rtol=1e-6, err_msg=f"step {step}")


# ------------------------------------------------------------------------------ path rules


def test_path_string_handles_dicts_and_nnx_state():
  class Tiny(nnx.Module):
    def __init__(self):
      self.proj = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      self.norm = nnx.RMSNorm(3, rngs=nnx.Rngs(0))

  nnx_paths = set(_by_path(nnx.state(Tiny(), nnx.Param)))
  assert nnx_paths == {"proj/kernel", "proj/bias", "norm/scale"}
  assert "layers/moe/experts/w_up" in _by_path(_toy_params())


def test_weight_decay_mask_and_groups_hit_the_right_paths():
  no_decay = _by_path(optim.path_mask(_toy_params(), optim.DEFAULT_NO_DECAY_PATTERNS))
  assert {p for p, skip in no_decay.items() if skip} == {
      "embed/embedding", "layers/attn/q_proj/bias", "layers/attn_norm/scale",
      "layers/moe/router/e_score_correction_bias", "final_norm/scale"}
  groups = _by_path(optim.param_groups(_toy_params(), use_muon=True,
                                       frozen_patterns=[r"correction_bias"]))
  assert groups == {
      "embed/embedding": "adamw", "layers/attn/q_proj/kernel": "muon",
      "layers/attn/q_proj/bias": "adamw", "layers/attn_norm/scale": "adamw",
      "layers/moe/experts/w_up": "muon", "layers/moe/router/kernel": "muon",
      "layers/moe/router/e_score_correction_bias": "frozen", "final_norm/scale": "adamw",
      "lm_head/kernel": "adamw"}


# What the real model's parameters get: group (frozen | muon | adamw), weight decay, and the
# axes Muon orthogonalises over ("-" for parameters Muon never sees). Keys are paths inside a
# decoder block (dense stack, MoE stack and MTP modules share them) or top-level paths.
_BLOCK_RULES = {
    "attn/q_a": ("muon", True, ((-2,), (-1,))), "attn/q_b": ("muon", True, ((-3,), (-2, -1))),
    "attn/kv_a": ("muon", True, ((-2,), (-1,))), "attn/kv_b": ("muon", True, ((-3,), (-2, -1))),
    "attn/out": ("muon", True, ((-3, -2), (-1,))),
    "attn/q_a_norm/scale": ("adamw", False, "-"), "attn/kv_a_norm/scale": ("adamw", False, "-"),
    "attn_norm/scale": ("adamw", False, "-"), "ffn_norm/scale": ("adamw", False, "-"),
    "mlp/gate": ("muon", True, ((-2,), (-1,))), "mlp/up": ("muon", True, ((-2,), (-1,))),
    "mlp/down": ("muon", True, ((-2,), (-1,))),
    "moe/router": ("muon", True, ((-2,), (-1,))),
    "moe/correction_bias": ("frozen", False, "-"),  # moved only by the aux-loss-free rule
    # Routed experts [L, E, D, F]: one orthogonalised [D, F] matrix per layer and expert.
    "moe/gate": ("muon", True, ((-2,), (-1,))), "moe/up": ("muon", True, ((-2,), (-1,))),
    "moe/down": ("muon", True, ((-2,), (-1,))),
    "moe/shared/gate": ("muon", True, ((-2,), (-1,))),
    "moe/shared/up": ("muon", True, ((-2,), (-1,))),
    "moe/shared/down": ("muon", True, ((-2,), (-1,))),
}
_TOP_RULES = {
    "embed/embedding": ("adamw", False, "-"), "final_norm/scale": ("adamw", False, "-"),
    "lm_head": ("adamw", True, "-"),
    "mtp_0/eh_proj": ("muon", True, ((-2,), (-1,))), "mtp_0/enorm/scale": ("adamw", False, "-"),
    "mtp_0/hnorm/scale": ("adamw", False, "-"), "mtp_0/head_norm/scale": ("adamw", False, "-"),
}


def test_path_rules_on_the_real_parameter_tree():
  """Every parameter of the real model (dense + MoE stacks, MTP, untied head) lands in the group
  the optimizer docs promise, with the trainer's own frozen pattern; a parameter no rule here
  names fails the test, so a new module must state how it is optimised."""
  from c2 import model  # pylint: disable=import-outside-toplevel
  cfg = model.get_preset("tiny")
  assert cfg.first_k_dense and cfg.num_moe_layers and cfg.mtp_depth and not cfg.tie_word_embeddings
  params = model.abstract_params(cfg)
  groups = _by_path(optim.param_groups(params, use_muon=True, frozen_patterns=[model.ROUTER_BIAS]))
  no_decay = _by_path(optim.path_mask(params, optim.DEFAULT_NO_DECAY_PATTERNS))
  seen = set()
  for path, group in groups.items():
    parts = path.split("/")
    inner = "/".join(parts[2:]) if "block" in parts[:2] else None
    rule = _BLOCK_RULES.get(inner) if inner is not None else _TOP_RULES.get(path)
    assert rule is not None, f"no expectation for parameter {path}"
    want_group, want_decay, want_axes = rule
    assert (group, not no_decay[path]) == (want_group, want_decay), path
    if want_group == "muon":
      axes = optim.matrix_axes_for(path, optim.DEFAULT_MATRIX_AXES_RULES)
      assert (axes.rows, axes.cols) == want_axes, path
    seen.add(inner if inner is not None else path)
  assert seen == set(_BLOCK_RULES) | set(_TOP_RULES)   # every expectation met a real parameter


# -------------------------------------------------------------------------- optimizer chain


def test_clipping_caps_global_norm_and_ignores_frozen_grads():
  grads = {"live": jnp.full((4,), 3.0), "frozen": jnp.full((4,), 100.0)}  # live norm 6
  tx = optim.freeze_and_clip(frozen_patterns=["frozen"], clip_norm=1.5)
  clipped, _ = tx.update(grads, tx.init(grads))
  np.testing.assert_allclose(optax.global_norm(clipped), 1.5, rtol=1e-6)
  np.testing.assert_array_equal(clipped["frozen"], 0.0)
  # Frozen grads are out of the norm: the live part is scaled by 1.5 / 6, not by 1.5 / 200.
  np.testing.assert_allclose(clipped["live"], 0.75, rtol=1e-6)
  small = {"live": jnp.full((4,), 0.1), "frozen": jnp.zeros((4,))}
  unchanged, _ = tx.update(small, tx.init(small))
  np.testing.assert_allclose(unchanged["live"], 0.1)


@pytest.mark.parametrize("use_muon", [False, True])
def test_weight_decay_only_on_decayed_paths_and_frozen_never_move(use_muon):
  params = _toy_params()
  opt = optim.build_optimizer(peak_lr=0.1, total_steps=10, warmup_steps=0, weight_decay=0.5,
                              use_muon=use_muon, frozen_patterns=[r"correction_bias", "lm_head"])
  state = opt.tx.init(params)
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, state = jax.jit(opt.tx.update)(zero_grads, state, params)
  moved = _by_path(jax.tree.map(lambda u: float(jnp.abs(u).max()), updates))
  decayed = {"layers/attn/q_proj/kernel", "layers/moe/experts/w_up", "layers/moe/router/kernel"}
  for path, amount in moved.items():
    if path in decayed:
      np.testing.assert_allclose(amount, 0.1 * 0.5 * 1.0, rtol=1e-5, err_msg=path)  # lr*wd*W
    else:
      assert amount == 0.0, path
  # Frozen parameters hold no optimizer buffers at all.
  buffer_shapes = [x.shape for x in jax.tree.leaves(state) if x.ndim]
  assert (2, 3) not in buffer_shapes and (4, 10) not in buffer_shapes


def test_state_is_float32_and_bf16_master_weights_are_rejected():
  params = _toy_params()
  opt = optim.build_optimizer(peak_lr=0.1, total_steps=10, warmup_steps=1, use_muon=True)
  state = jax.eval_shape(opt.tx.init, params)  # works abstractly, as the trainer calls it
  floats = [x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(d == jnp.float32 for d in floats)
  bf16 = dict(params, final_norm={"scale": jnp.ones((4,), jnp.bfloat16)})
  with pytest.raises(ValueError, match="final_norm/scale"):
    opt.tx.init(bf16)


@pytest.mark.parametrize("use_muon,peak_lr", [(False, 0.05), (True, 0.05)])
def test_tiny_regression_converges(use_muon, peak_lr):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  inputs = jax.random.normal(keys[0], (64, 8))
  true_w = jax.random.normal(keys[1], (8, 4))
  targets = inputs @ true_w + 0.5
  params = {"dense": {"kernel": 0.1 * jax.random.normal(keys[2], (8, 4)),
                      "bias": jnp.zeros((4,))}}

  def loss_fn(p):
    return jnp.mean((inputs @ p["dense"]["kernel"] + p["dense"]["bias"] - targets) ** 2)

  steps = 300
  opt = optim.build_optimizer(peak_lr=peak_lr, total_steps=steps, warmup_steps=10,
                              decay_fraction=0.3, weight_decay=0.0, use_muon=use_muon)

  @jax.jit
  def train(params):
    def step(carry, _):
      p, s = carry
      grads = jax.grad(loss_fn)(p)
      updates, s = opt.tx.update(grads, s, p)
      return (optax.apply_updates(p, updates), s), None
    (params, _), _ = jax.lax.scan(step, (params, opt.tx.init(params)), None, length=steps)
    return params

  initial = float(loss_fn(params))
  final = float(loss_fn(train(params)))
  assert final < 1e-3 * initial, (initial, final)


def test_muon_sees_the_full_mla_matrix_of_each_stacked_layer():
  assert optim.matrix_axes_for("params/layers/attn/q_b", optim.DEFAULT_MATRIX_AXES_RULES) == \
      MatrixAxes(rows=(-3,), cols=(-2, -1))
  assert optim.matrix_axes_for("params/layers/mlp/up", optim.DEFAULT_MATRIX_AXES_RULES) == \
      MatrixAxes()
  params = {"layers": {"attn": {"q_b": jnp.zeros((2, 6, 3, 4)), "out": jnp.zeros((2, 3, 4, 6))}}}
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(p.ndim + p.shape[1]),
                                                   p.shape), params)
  opt = optim.build_optimizer(peak_lr=0.1, total_steps=10, warmup_steps=0, weight_decay=0.0,
                              use_muon=True)
  updates, _ = jax.jit(opt.tx.update)(grads, opt.tx.init(params), params)
  # Step 1: momentum = G, so the Nesterov direction is a multiple of G and NS ignores the scale.
  for name, axes in [("q_b", MatrixAxes((-3,), (-2, -1))), ("out", MatrixAxes((-3, -2), (-1,)))]:
    grad = grads["layers"]["attn"][name]
    expected = -0.1 * jax.jit(orthogonalised_update, static_argnums=1)(grad, axes)
    np.testing.assert_allclose(updates["layers"]["attn"][name], expected, rtol=1e-4, atol=1e-6)
