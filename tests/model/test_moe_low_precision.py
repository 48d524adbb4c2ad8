"""The MoE layer through the Pallas grouped-matmul kernels in each format (interpret mode on CPU)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2 import model
from c2.model import dispatch
from c2.ops.gmm import grouped_matmul

pytest.importorskip("pallas_kernels")

# Relative error of the routed output vs float32, per format. Each bound is ~3x the measured
# matmul error of the format (pallas_kernels bench: bf16 2.3e-3, fp8/mxfp8 3.7e-2, nvfp4 1.3e-1
# mean relative), since three chained matmuls (gate, up, down) compound it.
TOLERANCE = {"bf16": 1e-2, "fp8": 1.2e-1, "mxfp8": 1.2e-1, "nvfp4": 4e-1}


def _experts(seed=0, n=96, d=64, f=32, e=8, k=2):
  rng = np.random.default_rng(seed)
  mk = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2]), jnp.float32)
  ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.2, 1.0, (n, k)), jnp.float32)
  return mk(n, d), ids, weights, mk(e, d, f), mk(e, d, f), mk(e, f, d)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp8", "nvfp4"])
def test_routed_experts_match_float32_within_format_tolerance(fmt):
  x, ids, w, gate, up, down = _experts()
  reference = dispatch.local_ffn(x, ids, w, gate, up, down,
                                 functools.partial(grouped_matmul, impl="ragged_dot"))
  got = dispatch.local_ffn(x, ids, w, gate, up, down,
                           functools.partial(grouped_matmul, impl="pallas", fmt=fmt))
  rel = float(jnp.linalg.norm(got - reference) / jnp.linalg.norm(reference))
  assert rel < TOLERANCE[fmt], (fmt, rel)
  if fmt != "bf16":  # the format really quantises: error well above bf16 rounding
    assert rel > 1e-3


def test_model_trains_with_nvfp4_forward_mxfp8_backward_and_mxfp8_dispatch(small_cfg):
  cfg = small_cfg.replace(gmm_impl="pallas", gmm_fmt="nvfp4", gmm_bwd_fmt="mxfp8",
                          dispatch_fmt="mxfp8", mtp_depth=0, dtype="bfloat16")
  params = model.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 32)), jnp.int32)

  def loss_fn(p):
    logits = model.logits(cfg, p, tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

  step = jax.jit(lambda p: jax.tree.map(lambda a, g: a - 0.05 * g, p, jax.grad(loss_fn)(p)))
  first = float(loss_fn(params))
  grads = jax.grad(loss_fn)(params)
  expert_grad = grads["moe_layers"]["block"]["moe"]["gate"]
  assert float(jnp.abs(expert_grad).sum()) > 0  # gradients flow through the kernels' VJP
  for _ in range(8):
    params = step(params)
  assert float(loss_fn(params)) < first - 0.1
