"""Functional entry points of the model: shapes, (sharded) init, forward, logits.

Params are a plain nested dict of arrays (Linen's, unboxed); every function here is pure.
  abstract_params(cfg)            -> ShapeDtypeStruct tree (no memory touched)
  param_shardings(cfg, mesh)      -> NamedSharding tree from the logical-axis rules
  init_params(cfg, rng, mesh)     -> params created directly in their shards
  forward(cfg, params, tokens...) -> dict(hidden, mtp_hidden, aux)   (see Transformer)
  logits(cfg, params, tokens...)  -> float32 [B, T, V]
  unstack_layers(params)          -> the per-layer tree of a ModelConfig(scan_layers=False)
  router_loads(aux) / router_biases(params) / update_router_biases(params, loads, rate)
                                  the routers' aux-loss-free correction biases, by router group

The model owns its parameter paths: steps, the sampler and the RL learner reach the router biases
through these functions, never by indexing `params[...]["moe"]` themselves.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2.losses import moe_balance
from c2.model.config import ModelConfig
from c2.model.latent_cache import (LayerCacheView, read_rows, window_sizes,
                                   write_entries)
from c2.model.layers import Embed
from c2.model.router import DEFAULT_REPLAY_FALLBACK, ReplayFallback
from c2.model.transformer import MTPModule, Transformer
from c2.parallel import sharding

Params = Any


def build(cfg: ModelConfig,
          replay_fallback: ReplayFallback = DEFAULT_REPLAY_FALLBACK) -> Transformer:
  return Transformer(cfg, replay_fallback)


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


STACKS = ("dense_layers", "moe_layers")  # the scanned layer stacks (params under "block")


def unstack_layers(params: Params) -> Params:
  """Stacked layer params {"block": [Y, ...]} -> {"layer_0": ..., "layer_{Y-1}": ...}, the tree
  of a ModelConfig with scan_layers=False (same values; other params as they are)."""
  out = dict(params)
  for name in STACKS:
    if name in params:
      stacked = params[name]["block"]
      count = jax.tree.leaves(stacked)[0].shape[0]
      out[name] = {f"layer_{i}": jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(count)}
  return out


def init_params(cfg: ModelConfig, rng: jax.Array, mesh: Optional[jax.sharding.Mesh] = None) -> Params:
  """Initialises params; with a mesh each array is created already sharded (never whole)."""
  init = lambda key: nn.meta.unbox(_init_boxed(cfg, key))
  if mesh is None:
    return jax.jit(init)(rng)
  return jax.jit(init, out_shardings=param_shardings(cfg, mesh))(rng)


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array,
            segment_ids: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
            forced_routes: Optional[jax.Array] = None, with_mtp: bool = True,
            detach_mtp_inputs: bool = False, cache: Optional[tuple] = None,
            replay_fallback: ReplayFallback = DEFAULT_REPLAY_FALLBACK,
            mtp_tokens: Optional[list] = None) -> dict:
  """See `Transformer.__call__`; `cache` = (stacks, rows, lengths) runs the decoding form.
  replay_fallback: the plausibility rule for forced_routes ("rank" default, "rank:M", a float
  margin, "off"; c2.model.router.replay_threshold); the RL config decides it."""
  return build(cfg, replay_fallback).apply({"params": params}, tokens, segment_ids, positions,
                                           forced_routes, with_mtp, detach_mtp_inputs, cache,
                                           mtp_tokens)


def mtp_step(cfg: ModelConfig, params: Params, depth: int, prev_hidden: jax.Array,
             next_tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array,
             stack: jax.Array, rows: Optional[jax.Array], lengths: jax.Array) -> dict:
  """One MTP module over new tokens with its latent cache (speculative drafting, c2/infer).

  prev_hidden [B, T, D]: the trunk's pre-norm hidden (depth 0) or the previous draft's `h`;
  next_tokens [B, T]: token t + 1 of each position; stack [M, slots, S, C] the MTP caches,
  `depth` (0-based) picks the module and its layer of the stack.
  -> dict(h [B, T, D] pre-norm, hidden [B, T, D] normed (project with head_kernel), kv_cache
  (updated stack), aux).
  """
  module_params = params[f"mtp_{depth}"]
  embeddings = Embed(cfg.vocab_size, cfg.hidden_size, jnp.dtype(cfg.dtype),
                     jnp.dtype(cfg.param_dtype)).apply({"params": params["embed"]}, next_tokens)
  # Every slot (decoding): the module writes its entries before reading (in place, see
  # LayerCacheView.write_through); a subset of rows is a gathered copy, scattered back after.
  view = LayerCacheView(read_rows(stack, depth, rows), lengths, write_through=rows is None,
                        windows=window_sizes(stack.shape[-2], cfg.cache_windows))
  h, hidden, aux = MTPModule(cfg).apply({"params": module_params}, prev_hidden, embeddings,
                                        segment_ids, positions, view)
  if rows is None:
    layer = aux.pop("kv_layer")[None]
  else:
    layer = jax.lax.dynamic_slice_in_dim(stack, depth, 1, axis=0)
    layer = write_entries(layer, rows, lengths, aux.pop("kv_entries")[None], segment_ids != 0)
  stack = jax.lax.dynamic_update_slice_in_dim(stack, layer, depth, axis=0)
  return {"h": h, "hidden": hidden, "kv_cache": stack, "aux": aux}


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


# ------------------------------------------------------------------------------ router biases
# Router groups: "trunk" is the scanned MoE stack (one bias row per layer, [L, E]); "mtp" the MTP
# modules' MoE blocks ([M, E], one row per depth).

ROUTER_BIAS = "correction_bias"  # the leaf name; the optimizer freezes it (moved by the rule below)


def _mtp_names(params: Params) -> list[str]:
  return sorted((k for k in params if k.startswith("mtp_")), key=lambda k: int(k[4:]))


def _moe(module: Params) -> Params:
  return module["block"]["moe"]


def router_loads(aux: dict) -> dict[str, jax.Array]:
  """The forward pass's per-expert token counts by router group: trunk [L, E], mtp [M, E]."""
  loads = {}
  if "moe" in aux:
    loads["trunk"] = aux["moe"]["load"]
  if "mtp_moe" in aux:
    loads["mtp"] = aux["mtp_moe"]["load"]
  return loads


def router_biases(params: Params) -> dict[str, jax.Array]:
  """The routers' correction biases by group: trunk [L, E], mtp [M, E] (absent groups left out)."""
  biases = {}
  if "moe_layers" in params:
    biases["trunk"] = _moe(params["moe_layers"])[ROUTER_BIAS]
  mtp = [_moe(params[name])[ROUTER_BIAS] for name in _mtp_names(params)
         if "moe" in params[name]["block"]]
  if mtp:
    biases["mtp"] = jnp.stack(mtp)
  return biases


def _with_bias(module: Params, bias: jax.Array) -> Params:
  return {**module, "block": {**module["block"], "moe": {**_moe(module), ROUTER_BIAS: bias}}}


def update_router_biases(params: Params, loads: dict[str, jax.Array], rate: float) -> Params:
  """One aux-loss-free step on every router whose group has a load: b <- b + rate *
  sign(mean load - load) (c2.losses.moe_balance). Returns new params; rate 0 returns them as is."""
  if not rate or not loads:
    return params
  params = dict(params)
  biases = router_biases(params)
  if "trunk" in loads:
    new = moe_balance.aux_free_bias_update(biases["trunk"], loads["trunk"], rate=rate)
    params["moe_layers"] = _with_bias(params["moe_layers"], new)
  if "mtp" in loads:
    new = moe_balance.aux_free_bias_update(biases["mtp"], loads["mtp"], rate=rate)
    for depth, name in enumerate(_mtp_names(params)):
      params[name] = _with_bias(params[name], new[depth])
  return params
