"""The language-model train step of pretraining and SFT.

  pretrain_step(state, batch, *, model_cfg, tx, loss_weights, bias_update_rate, schedule)
      -> (state, metrics)
Pure: jit it with explicit shardings and donate the state. After the optimizer update, the
routers' correction biases move by the aux-loss-free rule from this step's per-expert load; the
optimizer itself never touches them (they are listed as frozen).
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax

from c2 import losses
from c2.model_config import ModelConfig
from c2.objectives import LossWeights, lm_loss
from c2.state import TrainState

ROUTER_BIAS_PATTERN = "correction_bias"  # frozen in the optimizer; moved by the bias rule


def update_router_biases(params: dict, aux: dict, rate: float) -> dict:
  """Applies b <- b + rate * sign(mean_load - load) to every MoE layer's correction bias."""
  if not rate or "moe_load" not in aux:
    return params
  params = dict(params)
  stack = params["moe_layers"]
  moe = dict(stack["block"]["moe"])
  moe["correction_bias"] = losses.aux_free_bias_update(moe["correction_bias"], aux["moe_load"],
                                                       rate=rate)
  params["moe_layers"] = {**stack, "block": {**stack["block"], "moe": moe}}
  for depth, load in enumerate(aux.get("mtp_load", ())):
    module = params[f"mtp_{depth}"]
    mtp_moe = dict(module["block"]["moe"])
    mtp_moe["correction_bias"] = losses.aux_free_bias_update(mtp_moe["correction_bias"], load,
                                                             rate=rate)
    params[f"mtp_{depth}"] = {**module, "block": {**module["block"], "moe": mtp_moe}}
  return params


def moe_metrics(params: dict, aux: dict) -> dict:
  """Load balance of the step (worst layer and mean over layers) and bias statistics."""
  if "moe_load" not in aux:
    return {}
  stats = losses.load_stats(aux["moe_load"])  # each [L]
  bias = params["moe_layers"]["block"]["moe"]["correction_bias"]
  return {
      "moe/load_max_over_mean": jnp.max(stats["max_over_mean"]),
      "moe/load_max_over_mean_avg": jnp.mean(stats["max_over_mean"]),
      "moe/load_entropy": jnp.mean(stats["entropy"]),
      "moe/load_cv": jnp.mean(stats["cv"]),
      "moe/bias_abs_mean": jnp.mean(jnp.abs(bias)),
      "moe/bias_abs_max": jnp.max(jnp.abs(bias)),
  }


def pretrain_step(state: TrainState, batch: dict, *, model_cfg: ModelConfig,
                  tx: optax.GradientTransformation, loss_weights: LossWeights,
                  bias_update_rate: float = 0.0,
                  schedule: Optional[Callable] = None) -> tuple[TrainState, dict]:
  """One optimizer step on a global batch (tokens, segment_ids, positions, loss_mask [B, T])."""
  def loss_fn(params):
    return lm_loss(model_cfg, params, batch, loss_weights)

  (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  params = update_router_biases(params, aux, bias_update_rate)
  metrics = dict(aux["metrics"])
  metrics["grad_norm"] = optax.global_norm(grads)
  metrics["update_norm"] = optax.global_norm(updates)
  if schedule is not None:
    metrics["learning_rate"] = schedule(state.step)
  metrics.update(moe_metrics(params, aux))
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params: dict, batch: dict, *, model_cfg: ModelConfig,
              loss_weights: LossWeights) -> dict:
  """Loss metrics on a batch without updating anything (same objective as training)."""
  _, aux = lm_loss(model_cfg, params, batch, loss_weights)
  return aux["metrics"]
