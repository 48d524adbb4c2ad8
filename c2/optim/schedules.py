"""Learning-rate schedules: step -> learning rate, traceable (the step logs it, optax applies it).

  wsd_schedule     warmup-stable-decay (linear | cosine | sqrt cooldown)
  cosine_schedule  warmup, then a half cosine to the final rate
"""
from typing import Callable

import jax
import jax.numpy as jnp

Schedule = Callable[[jax.Array | int], jax.Array]


def _warmup(step, peak_lr: float, warmup_steps: int):
  return peak_lr * step / max(warmup_steps, 1)


def wsd_schedule(*, peak_lr: float, total_steps: int, warmup_steps: int,
                 decay_fraction: float = 0.1, decay_shape: str = "linear",
                 final_lr: float = 0.0) -> Schedule:
  """Warmup-stable-decay: linear 0 -> peak over warmup_steps, constant, then decay to final_lr.

  The decay covers the last round(decay_fraction * total_steps) steps and ends exactly at
  total_steps; later steps stay at final_lr. Shapes, with progress u in [0, 1] through the decay:
  linear peak - (peak - final) u; cosine final + (peak - final)(1 + cos(pi u)) / 2;
  sqrt peak - (peak - final) sqrt(u) (the "1-sqrt" cooldown of Hägele et al. 2024).
  K2 pretraining used warmup 500 then a long constant phase and a cosine decay.
  """
  decay_steps = int(round(decay_fraction * total_steps))
  decay_start = total_steps - decay_steps
  if not 0 <= warmup_steps <= decay_start:
    raise ValueError(f"warmup {warmup_steps} must fit before the decay start {decay_start}")
  shapes = {
      "linear": lambda u: u,
      "cosine": lambda u: 0.5 * (1.0 - jnp.cos(jnp.pi * u)),
      "sqrt": jnp.sqrt,
  }
  if decay_shape not in shapes:
    raise ValueError(f"decay_shape must be one of {sorted(shapes)}, got {decay_shape!r}")
  drop = shapes[decay_shape]

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    progress = jnp.clip((step - decay_start) / max(decay_steps, 1), 0.0, 1.0)
    decayed = peak_lr - (peak_lr - final_lr) * drop(progress)
    return jnp.where(step < warmup_steps, _warmup(step, peak_lr, warmup_steps), decayed)

  return schedule


def cosine_schedule(*, peak_lr: float, total_steps: int, warmup_steps: int,
                    final_lr: float = 0.0) -> Schedule:
  """Linear warmup 0 -> peak, then a half cosine from peak at warmup_steps to final_lr at
  total_steps (constant afterwards)."""
  if not 0 <= warmup_steps < total_steps:
    raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    progress = jnp.clip((step - warmup_steps) / (total_steps - warmup_steps), 0.0, 1.0)
    cosine = final_lr + (peak_lr - final_lr) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return jnp.where(step < warmup_steps, _warmup(step, peak_lr, warmup_steps), cosine)

  return schedule
