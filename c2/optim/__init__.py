"""Optimizers (AdamW, Muon), learning-rate schedules and the path rules that group parameters.

  from c2 import optim
  opt = optim.build_optimizer(peak_lr=..., total_steps=..., warmup_steps=...)  # (tx, schedule)
"""
from c2.optim.optimizer import Optimizer, build_optimizer, freeze_and_clip
from c2.optim.param_groups import (DEFAULT_ADAMW_ONLY_PATTERNS, DEFAULT_MATRIX_AXES_RULES,
                                   DEFAULT_NO_DECAY_PATTERNS, matrix_axes_for, param_groups,
                                   path_mask, path_string)
from c2.optim.schedules import Schedule, cosine_schedule, wsd_schedule

__all__ = ["Optimizer", "build_optimizer", "freeze_and_clip", "DEFAULT_ADAMW_ONLY_PATTERNS",
           "DEFAULT_MATRIX_AXES_RULES", "DEFAULT_NO_DECAY_PATTERNS", "matrix_axes_for",
           "param_groups", "path_mask", "path_string", "Schedule", "cosine_schedule",
           "wsd_schedule"]
