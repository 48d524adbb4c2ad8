"""Pure steps, one signature for every phase, found only through `STEPS`.

  train: step(state, batch, *, ctx: StepContext) -> (state, metrics)
  eval:  eval_step(params, batch, *, ctx: StepContext) -> metrics
The trainer and the AOT check look a phase up here (through c2.train.program); a phase missing
from the table is rejected when the experiment config is validated (c2.config), before any data
is read or state restored. A new phase (e.g. long context) registers itself here.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from c2.steps.context import StepContext
from c2.steps.lm import lm_eval_step, lm_step
from c2.steps.rl import rl_eval_step, rl_step


@dataclasses.dataclass(frozen=True)
class PhaseSteps:
  train: Callable
  eval: Callable


STEPS: dict[str, PhaseSteps] = {
    "pretrain": PhaseSteps(train=lm_step, eval=lm_eval_step),
    "sft": PhaseSteps(train=lm_step, eval=lm_eval_step),
    "long_context": PhaseSteps(train=lm_step, eval=lm_eval_step),  # longer rows, same objective
    "rl": PhaseSteps(train=rl_step, eval=rl_eval_step),
}

__all__ = ["STEPS", "PhaseSteps", "StepContext"]
