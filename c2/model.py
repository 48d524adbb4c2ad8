"""Functional entry points of the model: shapes, (sharded) init, forward, logits.

Params are a plain nested dict of arrays (Linen's, unboxed); every function here is pure.
  abstract_params(cfg)            -> ShapeDtypeStruct tree (no memory touched)
  param_shardings(cfg, mesh)      -> NamedSharding tree from the logical-axis rules
  init_params(cfg, rng, mesh)     -> params created directly in their shards
  forward(cfg, params, tokens...) -> dict(hidden, mtp_hidden, aux)   (see Transformer)
  logits(cfg, params, tokens...)  -> float32 [B, T, V]
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2 import sharding
from c2.model_config import ModelConfig
from c2.nn.transformer import Transformer

Params = Any


def build(cfg: ModelConfig) -> Transformer:
  return Transformer(cfg)


def _init_boxed(cfg: ModelConfig, rng: jax.Array):
  tokens = jnp.zeros((1, 2), jnp.int32)
  return build(cfg).init(rng, tokens)["params"]


def abstract_boxed_params(cfg: ModelConfig):
  """eval_shape of init, keeping the logical-axis annotations (nn.LogicallyPartitioned)."""
  return jax.eval_shape(lambda: _init_boxed(cfg, jax.random.key(0)))


def abstract_params(cfg: ModelConfig) -> Params:
  return nn.meta.unbox(abstract_boxed_params(cfg))


def param_specs(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> Params:
  return sharding.param_specs(abstract_boxed_params(cfg), mesh)


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> Params:
  return sharding.named_shardings(param_specs(cfg, mesh), mesh)


def init_params(cfg: ModelConfig, rng: jax.Array, mesh: Optional[jax.sharding.Mesh] = None) -> Params:
  """Initialises params; with a mesh each array is created already sharded (never whole)."""
  init = lambda key: nn.meta.unbox(_init_boxed(cfg, key))
  if mesh is None:
    return jax.jit(init)(rng)
  return jax.jit(init, out_shardings=param_shardings(cfg, mesh))(rng)


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array,
            segment_ids: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
            forced_routes: Optional[jax.Array] = None, with_mtp: bool = True,
            detach_mtp_inputs: bool = False) -> dict:
  return build(cfg).apply({"params": params}, tokens, segment_ids, positions, forced_routes,
                          with_mtp, detach_mtp_inputs)


def head_kernel(cfg: ModelConfig, params: Params) -> jax.Array:
  """[D, V] output projection (shared by the main head and every MTP depth)."""
  if cfg.tie_word_embeddings:
    return params["embed"]["embedding"].T
  return params["lm_head"]


def logits(cfg: ModelConfig, params: Params, tokens: jax.Array,
           segment_ids: Optional[jax.Array] = None,
           positions: Optional[jax.Array] = None) -> jax.Array:
  """tokens [B, T] -> float32 logits [B, T, V] of the main head. Materialises all logits: for
  evaluation and tests; training goes through the chunked losses instead."""
  hidden = forward(cfg, params, tokens, segment_ids, positions, with_mtp=False)["hidden"]
  return jnp.einsum("BTD,DV->BTV", hidden.astype(jnp.float32),
                    head_kernel(cfg, params).astype(jnp.float32))


def mtp_logits(cfg: ModelConfig, params: Params, tokens: jax.Array,
               segment_ids: Optional[jax.Array] = None,
               positions: Optional[jax.Array] = None) -> jax.Array:
  """float32 [M, B, T, V]: MTP depth k at position t predicts token t + k + 1."""
  hidden = forward(cfg, params, tokens, segment_ids, positions)["mtp_hidden"]
  return jnp.einsum("MBTD,DV->MBTV", hidden.astype(jnp.float32),
                    head_kernel(cfg, params).astype(jnp.float32))
