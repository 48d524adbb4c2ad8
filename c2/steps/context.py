"""What a step needs besides the state and the batch, in one frozen object.

Every phase's step has the same signature, `step(state, batch, *, ctx) -> (state, metrics)`, and
its eval step `eval_step(params, batch, *, ctx) -> metrics`; the root (c2.train.program) builds
the context from the experiment config once, so steps see plain values, never the config.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import optax

from c2.losses.lm import LossWeights
from c2.losses.rl import RLLossWeights
from c2.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StepContext:
  model: ModelConfig
  tx: optax.GradientTransformation
  loss_weights: LossWeights
  bias_update_rate: float = 0.0  # aux-loss-free router bias speed (0 freezes the biases)
  schedule: Optional[Callable] = None  # step -> learning rate, logged as train/learning_rate
  rl: Optional[RLLossWeights] = None  # the RL step's objective (c2/steps/rl.py)
