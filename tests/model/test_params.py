"""Analytic parameter counts agree with the parameter tree and with the published Kimi figures."""
import jax
import numpy as np
import pytest

from c2 import model
from c2.perf import flops
from c2.model.config import get_preset

# From the K2/K2.5 config: the text backbone without MTP holds 1,026,408,232,448 weights (the
# K2 FP8 checkpoint's 1,026,470,731,056 numbers add ~62.5M block-scale values); one DeepSeek-style
# MTP module adds 17,162,147,200, which gives the published "1.04T".
KIMI_BACKBONE = 1_026_408_232_448
KIMI_MTP_MODULE = 17_162_147_200


def _tree_count(cfg, mtp_only=False):
  counts = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(model.abstract_params(cfg))[0]:
    is_mtp = jax.tree_util.keystr(path[:1]).startswith("['mtp_")
    if is_mtp or not mtp_only:
      counts += int(np.prod(leaf.shape))
  return counts


def test_kimi_k25_counts_exact():
  cfg = get_preset("kimi-k2.5")
  counts = flops.param_counts(cfg)
  assert counts.total_without_mtp == KIMI_BACKBONE
  assert counts.mtp_total == KIMI_MTP_MODULE
  assert _tree_count(cfg) == KIMI_BACKBONE + KIMI_MTP_MODULE  # eval_shape, no memory touched
  assert _tree_count(cfg, mtp_only=True) == KIMI_MTP_MODULE
  assert counts.total == pytest.approx(1.04e12, rel=0.005)
  # "32B active": 8 of 384 experts per token.
  assert counts.active_without_mtp == pytest.approx(32.86e9, rel=0.001)
  assert _tree_count(cfg.replace(mtp_depth=0)) == KIMI_BACKBONE


@pytest.mark.parametrize("name", ["tiny", "proxy-30b", "kimi-k2"])
def test_counts_match_tree(name):
  cfg = get_preset(name)
  assert flops.param_counts(cfg).total == _tree_count(cfg)


def test_proxy_is_30b_a3b_class():
  counts = flops.param_counts(get_preset("proxy-30b"))
  assert 25e9 < counts.total < 35e9
  assert 2.5e9 < counts.active < 4e9


def test_tiny_is_a_few_million_and_same_structure():
  cfg = get_preset("tiny")
  assert 1e6 < flops.param_counts(cfg).total < 10e6
  assert cfg.first_k_dense >= 1 and cfg.num_moe_layers >= 1 and cfg.mtp_depth >= 1
  assert cfg.num_shared_experts >= 1 and cfg.q_lora_rank and cfg.rope_scaling is not None


def test_init_scales_every_kernel_by_its_own_fan_in():
  """Each kernel's std is 1/sqrt(the dims its einsum contracts), per layer and per expert: flax's
  default fan-in counts every leading dim, which scaled q_b [Q, H, K] and kv_b [L, H, X] by
  1/sqrt(Q x H) and the routed experts [E, D, F] by 1/sqrt(E x D) (19.6x too small at 384
  experts). The tiny model with 64 experts makes the expert error 8x in std."""
  cfg = get_preset("tiny", num_routed_experts=64)
  params = model.init_params(cfg, jax.random.key(0))
  attn, moe = params["moe_layers"]["block"]["attn"], params["moe_layers"]["block"]["moe"]
  d, q, lat = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
  expected = {
      "q_a": (attn["q_a"], d), "q_b": (attn["q_b"], q), "kv_a": (attn["kv_a"], d),
      "kv_b": (attn["kv_b"], lat), "out": (attn["out"], cfg.num_heads * cfg.v_head_dim),
      "experts.gate": (moe["gate"], d), "experts.up": (moe["up"], d),
      "experts.down": (moe["down"], cfg.moe_ffn_size),
      "shared.down": (moe["shared"]["down"], cfg.shared_ffn_size)}
  for name, (kernel, fan_in) in expected.items():
    std = float(np.std(np.asarray(kernel)))
    assert std == pytest.approx(fan_in ** -0.5, rel=0.05), (name, std, fan_in ** -0.5)
  # Per expert too: each of the 64 matrices carries the whole variance.
  per_expert = np.asarray(moe["gate"]).std(axis=(0, 2, 3))
  assert per_expert.min() > 0.9 * d ** -0.5 and per_expert.max() < 1.1 * d ** -0.5
