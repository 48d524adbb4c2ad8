"""Small building blocks: weights with logical axes, RMSNorm, embedding, gated FFN.

Glossary: B batch, T length, D model width, F FFN hidden units, V vocabulary.
Weights are stored in `param_dtype` (float32 master copy) and cast to the compute `dtype`
at use, so the optimizer always updates float32 values.
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2.parallel.sharding import constrain

Initializer = Callable[..., jax.Array]


def default_init(scale: float = 1.0, in_axis=-2, out_axis=-1, batch_axis=()) -> Initializer:
  """Truncated-normal fan-in init, as for a Linear layer: the fan-in is the product of the
  contracted dims `in_axis`, not counting `batch_axis` (a stack of independent matrices, like
  the experts). A kernel with more than two dims must name them: flax's default (in -2, out -1)
  counts every leading dim as fan-in, so [Q, H, K] would be scaled by 1/sqrt(Q x H) and a
  stack of E experts [E, D, F] by 1/sqrt(E x D)."""
  return nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal", in_axis=in_axis,
                                          out_axis=out_axis, batch_axis=batch_axis)


def logical_param(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str | None],
                  init: Initializer, dtype) -> jax.Array:
  """Declares a parameter annotated with logical axis names (read by `c2.parallel.sharding`)."""
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


class RMSNorm(nn.Module):
  """y = scale * x / sqrt(mean(x^2) + eps), normalised in float32 like the reference."""

  eps: float
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  axis_name: str = "norm"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = logical_param(self, "scale", (x.shape[-1],), (self.axis_name,),
                          nn.initializers.ones, self.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (scale.astype(jnp.float32) * normed).astype(self.dtype)


class Embed(nn.Module):
  """Token embedding table [V, D]."""

  vocab_size: int
  features: int
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.embedding = logical_param(self, "embedding", (self.vocab_size, self.features),
                                   ("vocab", "embed"), nn.initializers.normal(1.0),
                                   self.param_dtype)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> [B, T, D]."""
    x = jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)
    return constrain(x, ("batch", "length", "act_embed"))


class GatedFFN(nn.Module):
  """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)), used for dense layers and shared experts."""

  hidden_size: int
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> [B, T, D]."""
    d = x.shape[-1]
    gate = logical_param(self, "gate", (d, self.hidden_size), ("embed", "mlp"), default_init(),
                         self.param_dtype)
    up = logical_param(self, "up", (d, self.hidden_size), ("embed", "mlp"), default_init(),
                       self.param_dtype)
    down = logical_param(self, "down", (self.hidden_size, d), ("mlp", "embed"), default_init(),
                         self.param_dtype)
    x = x.astype(self.dtype)
    g = jnp.einsum("BTD,DF->BTF", x, gate.astype(self.dtype))
    u = jnp.einsum("BTD,DF->BTF", x, up.astype(self.dtype))
    h = constrain(nn.silu(g) * u, ("batch", "length", "act_mlp"))
    y = jnp.einsum("BTF,FD->BTD", h, down.astype(self.dtype))
    return constrain(y, ("batch", "length", "act_embed"))
