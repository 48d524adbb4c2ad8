"""The training runtime: the program (jitted steps and shardings), the loop, state, checkpoints,
metrics. The RL learner reuses it."""
