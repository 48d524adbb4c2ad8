"""Pure train and eval steps: `step(state, batch, *, ...) -> (state, metrics)`.

`STEPS` maps a phase to its step function; the trainer and the AOT tool look it up here, so a
new phase (long context, RL learner, sampler decode) registers itself without special cases.
"""
from c2.steps.pretrain import pretrain_step

# SFT is the same objective with a loss mask on assistant tokens: the same step, not a fork.
STEPS = {"pretrain": pretrain_step, "sft": pretrain_step}
