"""Optimizer and learning-rate schedules, built from plain arguments.

One optax chain for every phase:
  zero frozen grads -> clip global norm -> per-parameter group:
    'adamw':  Adam moments -> decoupled weight decay (masked) -> * -lr
    'muon':   momentum + Newton-Schulz (c2/muon.py) -> decoupled weight decay (masked) -> * -lr
    'frozen': zero update and no optimizer state
Parameter groups and the weight-decay mask are chosen by regular expressions searched in the
'/'-joined parameter path (e.g. 'layers/moe/experts/w_up'), so the rules read like the checkpoint.

Master weights and every optimizer buffer are float32; the model casts to bf16 in its compute.
Muon reuses the AdamW learning rate and weight decay thanks to its RMS-matched update (Kimi K2's
MuonClip recipe; Composer 2 itself used AdamW, Composer 2.5 moved CPT to Muon).
"""
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from c2.muon import MatrixAxes, scale_by_muon

# Norm scales, biases, the router's selection bias and embeddings are not decayed: shrinking them
# changes the function without regularising capacity. The router bias is moved by
# c2.losses.aux_free_bias_update; list it in frozen_patterns so the optimizer never touches it.
DEFAULT_NO_DECAY_PATTERNS = (r"(^|/)(scale|bias)$", r"correction_bias", r"(^|/)embed")
# Muon is for hidden matrices; the embedding and output head are lookups/readouts whose rows see
# very different gradient scales, so they stay on AdamW (Moonlight, K2).
DEFAULT_ADAMW_ONLY_PATTERNS = (r"embed", r"(^|/)(lm_)?head", r"norm", r"(^|/)(scale|bias)$",
                               r"correction_bias")

# Muon must orthogonalise the matrix the layer actually applies. The MLA projections in
# c2/nn/attention.py are stored per head, [in, H, K] (q, q_b, kv_b) and [H, J, out] (out), so
# the default "last two dims" would orthogonalise one [H, K] block per input row instead of the
# [in, H*K] matrix. Negative axes keep a leading scanned-layers axis a batch axis. First match
# wins; unmatched parameters use the last two dims. (Per-head Muon, as in Composer 2.5's sharded
# Muon, would instead use rows=(-3,), cols=(-1,) for q_b.)
DEFAULT_MATRIX_AXES_RULES = (
    (r"(^|/)(q|q_b|kv_b)$", MatrixAxes(rows=(-3,), cols=(-2, -1))),
    (r"(^|/)out$", MatrixAxes(rows=(-3, -2), cols=(-1,))),
)

Schedule = Callable[[jax.Array | int], jax.Array]


class Optimizer(NamedTuple):
  tx: optax.GradientTransformation
  schedule: Schedule  # step -> learning rate, for logging


# ------------------------------------------------------------------------------ schedules


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


# ------------------------------------------------------------------------- parameter paths


def path_string(key_path: Sequence[Any]) -> str:
  """'/'-joined names of a jax key path: ('layers', 0, 'attn', 'q_proj', 'kernel') ->
  'layers/0/attn/q_proj/kernel'. nnx Variables add a trailing '.value' attribute; it is dropped so
  patterns anchored at the end ('bias$') work for nnx state and plain dicts alike."""
  names = []
  for key in key_path:
    if isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value":
      continue
    for field in ("key", "name", "idx"):
      if hasattr(key, field):
        names.append(str(getattr(key, field)))
        break
    else:
      names.append(str(key))
  return "/".join(names)


def _matches(path: str, patterns: Sequence[str]) -> bool:
  return any(re.search(p, path) for p in patterns)


def path_mask(params: Any, patterns: Sequence[str]) -> Any:
  """Tree of bools like params: True where any regex in `patterns` searches the path."""
  return jax.tree_util.tree_map_with_path(lambda kp, _: _matches(path_string(kp), patterns),
                                          params)


def matrix_axes_for(path: str, rules: Sequence[tuple[str, MatrixAxes]]) -> MatrixAxes:
  """The MatrixAxes of the first rule whose regex searches `path`; default the last two dims."""
  return next((axes for pattern, axes in rules if re.search(pattern, path)), MatrixAxes())


def param_groups(params: Any, *, frozen_patterns: Sequence[str] = (), use_muon: bool = False,
                 adamw_only_patterns: Sequence[str] = DEFAULT_ADAMW_ONLY_PATTERNS) -> Any:
  """Tree of 'frozen' | 'muon' | 'adamw' like params. Frozen wins; Muon takes every trainable
  parameter with >= 2 dims that no adamw_only pattern matches."""
  def group(key_path, leaf):
    path = path_string(key_path)
    if _matches(path, frozen_patterns):
      return "frozen"
    if use_muon and leaf.ndim >= 2 and not _matches(path, adamw_only_patterns):
      return "muon"
    return "adamw"

  return jax.tree_util.tree_map_with_path(group, params)


# ---------------------------------------------------------------------------------- chain


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
