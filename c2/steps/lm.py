"""The language-model steps of pretraining and SFT (SFT is the same objective with a loss mask
on assistant tokens: the same step, not a fork).

  lm_step(state, batch, *, ctx) -> (state, metrics)
  lm_eval_step(params, batch, *, ctx) -> metrics
Pure: jit them with explicit shardings and donate the state. After the optimizer update the
routers' correction biases move by the aux-loss-free rule from this step's per-expert load
(`c2.model.update_router_biases`); the optimizer itself never touches them (frozen).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from c2 import model as model_lib
from c2.losses import moe_balance
from c2.losses.lm import lm_loss
from c2.steps.context import StepContext
from c2.train.state import TrainState


def moe_metrics(params: dict, aux: dict) -> dict:
  """Load balance of the step over the trunk's MoE layers (worst layer and mean over layers)
  and the size of their correction biases."""
  loads = aux.get("router_load", {})
  if "trunk" not in loads:
    return {}
  stats = moe_balance.load_stats(loads["trunk"])  # each [L]
  bias = model_lib.router_biases(params)["trunk"]
  return {
      "moe/load_max_over_mean": jnp.max(stats["max_over_mean"]),
      "moe/load_max_over_mean_avg": jnp.mean(stats["max_over_mean"]),
      "moe/load_entropy": jnp.mean(stats["entropy"]),
      "moe/load_cv": jnp.mean(stats["cv"]),
      "moe/bias_abs_mean": jnp.mean(jnp.abs(bias)),
      "moe/bias_abs_max": jnp.max(jnp.abs(bias)),
  }


def lm_step(state: TrainState, batch: dict, *, ctx: StepContext) -> tuple[TrainState, dict]:
  """One optimizer step on a global batch (tokens, segment_ids, positions, loss_mask [B, T])."""
  def loss_fn(params):
    return lm_loss(ctx.model, params, batch, ctx.loss_weights)

  (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = ctx.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  params = model_lib.update_router_biases(params, aux.get("router_load", {}),
                                          ctx.bias_update_rate)
  metrics = dict(aux["metrics"])
  metrics["grad_norm"] = optax.global_norm(grads)
  metrics["update_norm"] = optax.global_norm(updates)
  if ctx.schedule is not None:
    metrics["learning_rate"] = ctx.schedule(state.step)
  metrics.update(moe_metrics(params, aux))
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def lm_eval_step(params: dict, batch: dict, *, ctx: StepContext) -> dict:
  """Loss metrics on a batch without updating anything (same objective as training)."""
  _, aux = lm_loss(ctx.model, params, batch, ctx.loss_weights)
  return aux["metrics"]
