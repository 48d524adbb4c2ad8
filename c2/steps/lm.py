"""The language-model steps of pretraining and SFT (SFT is the same objective with a loss mask
on assistant tokens: the same step, not a fork).

  lm_step(state, batch, *, ctx) -> (state, metrics)
  lm_eval_step(params, batch, *, ctx) -> metrics
Pure: jit them with explicit shardings and donate the state. The update itself (optimizer, router
bias rule, metrics) is c2/steps/update.py, shared with the RL step.
"""
from __future__ import annotations

from c2.losses.lm import lm_loss
from c2.steps.context import StepContext
from c2.steps.update import optimizer_step
from c2.train.state import TrainState


def lm_step(state: TrainState, batch: dict, *, ctx: StepContext) -> tuple[TrainState, dict]:
  """One optimizer step on a global batch (tokens, segment_ids, positions, loss_mask [B, T])."""
  return optimizer_step(state, lambda params: lm_loss(ctx.model, params, batch, ctx.loss_weights),
                        ctx=ctx)


def lm_eval_step(params: dict, batch: dict, *, ctx: StepContext) -> dict:
  """Loss metrics on a batch without updating anything (same objective as training)."""
  _, aux = lm_loss(ctx.model, params, batch, ctx.loss_weights)
  return aux["metrics"]
