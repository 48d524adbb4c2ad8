"""The update every phase's train step shares: gradients of an objective, the optimizer, the
aux-loss-free router-bias rule, and the step's metrics.

  optimizer_step(state, loss_fn, *, ctx) -> (state, metrics)
loss_fn(params) -> (loss, aux) with aux["metrics"] (scalars) and, for MoE models,
aux["router_load"] (c2.model.router_loads). After the optimizer update the routers' correction
biases move by the aux-loss-free rule from this step's per-expert load
(`c2.model.update_router_biases`); the optimizer itself never touches them (frozen).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from c2 import model as model_lib
from c2.losses import moe_balance
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


def optimizer_step(state: TrainState, loss_fn: Callable, *, ctx: StepContext
                   ) -> tuple[TrainState, dict]:
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
