"""Rotary position embeddings with YaRN scaling, as the DeepseekV3/Kimi checkpoints expect them.

Pure functions. Glossary: B batch, T length, H heads, R rotary dims (qk_rope_head_dim).

YaRN here is the dimension-index ramp form of the reference implementation:
  corr_dim(n) = R * ln(L / (2 pi n)) / (2 ln base)       L = original_max_position_embeddings
  low = max(floor(corr_dim(beta_fast)), 0), high = min(ceil(corr_dim(beta_slow)), R - 1)
  ramp_i = clip((i - low) / (high - low), 0, 1) over pair index i; w_i = 1 - ramp_i
  inv_freq_i = w_i * theta_i + (1 - w_i) * theta_i / factor
High-frequency pairs (many turns within L) keep their frequency; low-frequency pairs are
interpolated by `factor`. cos/sin are multiplied by mscale(factor, mscale)/mscale(factor,
mscale_all_dim) (1.0 for every released Kimi config); the temperature goes into the softmax
scale instead (`ModelConfig.softmax_scale`).

Pairing: checkpoint weights put rotary pairs at interleaved positions (x[2i], x[2i+1]). We rotate
those pairs and emit them de-interleaved ([evens', odds']); queries and keys get the same
permutation, so every dot product equals the interleaved rotation's.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from c2.model.config import YarnScaling, yarn_mscale


def inverse_frequencies(rotary_dim: int, theta: float,
                        scaling: Optional[YarnScaling]) -> tuple[np.ndarray, float]:
  """Returns (inv_freq [R/2] float32, cos/sin multiplier)."""
  exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
  pos_freqs = np.power(np.float32(theta), exponents, dtype=np.float32)
  inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
  if scaling is None:
    return inv_freq, 1.0

  def corr_dim(num_rotations: float) -> float:
    return (rotary_dim * math.log(scaling.original_max_position_embeddings /
                                  (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

  low = max(math.floor(corr_dim(scaling.beta_fast)), 0)
  high = min(math.ceil(corr_dim(scaling.beta_slow)), rotary_dim - 1)
  if low == high:
    high += 0.001  # The reference's guard against a zero-width ramp.
  ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (keep), 0: interpolate
  interpolated = (np.float32(1.0) / (np.float32(scaling.factor) * pos_freqs)).astype(np.float32)
  inv_freq = (interpolated * (1 - keep) + inv_freq * keep).astype(np.float32)
  # With both mscales given their ratio scales cos/sin; with one missing the reference falls back
  # to the plain YaRN temperature on cos/sin. Kept identical so imported checkpoints match.
  if scaling.mscale and scaling.mscale_all_dim:
    attention_factor = yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
        scaling.factor, scaling.mscale_all_dim)
  else:
    attention_factor = yarn_mscale(scaling.factor)
  return inv_freq, float(attention_factor)


def rotary_angles(positions: jax.Array, rotary_dim: int, theta: float,
                  scaling: Optional[YarnScaling]) -> tuple[jax.Array, jax.Array]:
  """positions [B, T] int -> (cos, sin), each [B, T, R/2] float32 (multiplier applied)."""
  inv_freq, multiplier = inverse_frequencies(rotary_dim, theta, scaling)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, R/2]
  return jnp.cos(angles) * multiplier, jnp.sin(angles) * multiplier


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates interleaved pairs of x [B, T, H, R] (or [B, T, R]); returns de-interleaved [.., R].

  cos/sin are [B, T, R/2]; a heads axis is broadcast when x has one.
  """
  if x.ndim == cos.ndim + 1:
    cos, sin = cos[..., None, :], sin[..., None, :]
  x32 = x.astype(jnp.float32)
  evens, odds = x32[..., 0::2], x32[..., 1::2]
  rotated = jnp.concatenate([evens * cos - odds * sin, odds * cos + evens * sin], axis=-1)
  return rotated.astype(x.dtype)
