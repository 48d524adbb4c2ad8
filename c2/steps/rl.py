"""The RL learner's step: one optimizer update on a packed batch of graded rollouts.

  rl_step(state, batch, *, ctx) -> (state, metrics)       batch: see c2/losses/rl.py
  rl_eval_step(params, batch, *, ctx) -> metrics
  rl_reference_logp(params, batch, *, ctx) -> [B, T]     the k1 KL's reference log-probs
Same shape as the LM step (c2/steps/lm.py): the objective comes from the shared loss library
(c2/losses/rl.py over c2/losses/policy_gradient.py), the optimizer and the aux-loss-free router
bias update are the same; only the loss differs. `ctx.rl` carries the RL loss weights.
"""
from __future__ import annotations

from c2.losses.rl import reference_logprobs, rl_loss
from c2.steps.context import StepContext
from c2.steps.update import optimizer_step
from c2.train.state import TrainState


def _weights(ctx: StepContext):
  if ctx.rl is None:
    raise ValueError("rl_step needs StepContext.rl (c2.losses.rl.RLLossWeights)")
  return ctx.rl


def rl_step(state: TrainState, batch: dict, *, ctx: StepContext) -> tuple[TrainState, dict]:
  weights = _weights(ctx)
  return optimizer_step(state, lambda params: rl_loss(ctx.model, params, batch, weights), ctx=ctx)


def rl_eval_step(params: dict, batch: dict, *, ctx: StepContext) -> dict:
  """The objective's metrics (mismatch, KL, override rate) without an update."""
  _, aux = rl_loss(ctx.model, params, batch, _weights(ctx))
  return aux["metrics"]


def rl_reference_logp(params: dict, batch: dict, *, ctx: StepContext):
  """The reference policy's log-prob of every model token (the batch's `ref_logp`)."""
  return reference_logprobs(ctx.model, params, batch, _weights(ctx))
