"""The training optimizer, built from plain arguments.

One optax chain for every phase:
  zero frozen grads -> clip global norm -> per-parameter group:
    'adamw':  Adam moments -> decoupled weight decay (masked) -> * -lr
    'muon':   momentum + Newton-Schulz (c2/optim/muon.py) -> decoupled weight decay (masked) -> * -lr
    'frozen': zero update and no optimizer state
Parameter groups and the weight-decay mask are chosen by path rules (c2/optim/param_groups.py);
the schedules are in c2/optim/schedules.py.

Master weights and every optimizer buffer are float32; the model casts to bf16 in its compute.
Muon reuses the AdamW learning rate and weight decay thanks to its RMS-matched update (Kimi K2's
MuonClip recipe; Composer 2 itself used AdamW, Composer 2.5 moved CPT to Muon).
"""
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from c2.optim.muon import MatrixAxes, scale_by_muon
from c2.optim.param_groups import (DEFAULT_ADAMW_ONLY_PATTERNS, DEFAULT_MATRIX_AXES_RULES,
                                   DEFAULT_NO_DECAY_PATTERNS, matrix_axes_for, param_groups,
                                   path_mask, path_string)
from c2.optim.schedules import Schedule, cosine_schedule, wsd_schedule


class Optimizer(NamedTuple):
  tx: optax.GradientTransformation
  schedule: Schedule  # step -> learning rate, for logging


def freeze_and_clip(*, frozen_patterns: Sequence[str], clip_norm: float | None
                    ) -> optax.GradientTransformation:
  """Zeroes frozen parameters' gradients, then clips the global norm to clip_norm (None: off).

  Zeroing first keeps gradients of frozen weights out of the norm, so freezing part of the model
  does not silently shrink the step of the rest.
  """
  zero_frozen = optax.masked(optax.set_to_zero(), lambda p: path_mask(p, frozen_patterns))
  clip = optax.clip_by_global_norm(clip_norm) if clip_norm else optax.identity()
  return optax.chain(zero_frozen, clip)


def _float32_guard(labels: Callable[[Any], Any]) -> optax.GradientTransformation:
  """Identity on updates; init fails on a trainable parameter that is not float32, since a bf16
  master weight would silently make its Adam buffers bf16 too."""
  def init_fn(params):
    for (key_path, leaf), group in zip(jax.tree_util.tree_leaves_with_path(params),
                                       jax.tree.leaves(labels(params))):
      if group != "frozen" and leaf.dtype != jnp.float32:
        raise ValueError(f"trainable parameter {path_string(key_path)} is {leaf.dtype}; keep "
                         "float32 master weights and cast in the model")
    return optax.EmptyState()

  return optax.GradientTransformation(init_fn, lambda updates, state, params=None: (updates, state))


def build_optimizer(*, peak_lr: float, total_steps: int, warmup_steps: int,
                    schedule: str = "wsd", decay_fraction: float = 0.1,
                    decay_shape: str = "linear", final_lr: float = 0.0,
                    b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                    weight_decay: float = 0.1, clip_norm: float | None = 1.0,
                    no_decay_patterns: Sequence[str] = DEFAULT_NO_DECAY_PATTERNS,
                    frozen_patterns: Sequence[str] = (),
                    use_muon: bool = False, muon_momentum: float = 0.95,
                    muon_nesterov: bool = True, muon_ns_steps: int = 5,
                    adamw_only_patterns: Sequence[str] = DEFAULT_ADAMW_ONLY_PATTERNS,
                    muon_matrix_axes_rules: Sequence[tuple[str, MatrixAxes]] = (
                        DEFAULT_MATRIX_AXES_RULES),
                    ) -> Optimizer:
  """The training optimizer and its learning-rate schedule.

  Args:
    peak_lr, total_steps, warmup_steps: schedule scale and length (optimizer steps).
    schedule: 'wsd' (warmup-stable-decay; decay_fraction, decay_shape in linear|cosine|sqrt) or
      'cosine' (decay over everything after warmup). Both end at final_lr.
    b1, b2, eps: Adam moments (DeepSeek-V3 pretraining: 0.9, 0.95).
    weight_decay: decoupled, multiplied by the scheduled lr (W -= lr * wd * W), for both groups.
    clip_norm: global gradient-norm cap over trainable parameters; None disables.
    no_decay_patterns: regexes of paths excluded from weight decay.
    frozen_patterns: regexes of paths that never move and get no optimizer state.
    use_muon: route matrices (ndim >= 2, not matched by adamw_only_patterns) to Muon.
    muon_momentum, muon_nesterov, muon_ns_steps: Muon settings.
    muon_matrix_axes_rules: (path regex, MatrixAxes) pairs naming a Muon parameter's row and
      column axes, first match wins; unmatched: the last two dims, all leading dims are stacked
      layers/experts orthogonalised separately.

  Returns:
    Optimizer(tx, schedule).
  """
  if schedule == "wsd":
    lr = wsd_schedule(peak_lr=peak_lr, total_steps=total_steps, warmup_steps=warmup_steps,
                      decay_fraction=decay_fraction, decay_shape=decay_shape, final_lr=final_lr)
  elif schedule == "cosine":
    lr = cosine_schedule(peak_lr=peak_lr, total_steps=total_steps, warmup_steps=warmup_steps,
                         final_lr=final_lr)
  else:
    raise ValueError(f"schedule must be 'wsd' or 'cosine', got {schedule!r}")

  def decay_mask(params):
    return jax.tree.map(lambda no_decay: not no_decay, path_mask(params, no_decay_patterns))

  def matrix_axes(updates):
    return jax.tree_util.tree_map_with_path(
        lambda kp, _: matrix_axes_for(path_string(kp), muon_matrix_axes_rules), updates)

  def finish(direction):
    # Decay is added before the lr scaling, so the applied decay is lr * wd * W (AdamW, K2).
    return optax.chain(direction, optax.add_decayed_weights(weight_decay, decay_mask),
                       optax.scale_by_learning_rate(lr))

  groups = {
      "adamw": finish(optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=jnp.float32)),
      "frozen": optax.set_to_zero(),
  }
  if use_muon:
    groups["muon"] = finish(scale_by_muon(momentum=muon_momentum, nesterov=muon_nesterov,
                                          ns_steps=muon_ns_steps, matrix_axes=matrix_axes))

  def labels(params):
    return param_groups(params, frozen_patterns=frozen_patterns, use_muon=use_muon,
                        adamw_only_patterns=adamw_only_patterns)

  tx = optax.chain(_float32_guard(labels),
                   freeze_and_clip(frozen_patterns=frozen_patterns, clip_norm=clip_norm),
                   optax.multi_transform(groups, labels))
  return Optimizer(tx=tx, schedule=lr)
