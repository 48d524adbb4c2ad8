"""The train state pytree and how it is created: shapes first, then shardings, then values.

  abstract_state(...)   ShapeDtypeStructs of the whole state (no memory)
  state_shardings(...)  NamedShardings: params by the logical rules; optimizer state mirrors them
  init_state(...)       jit(init, out_shardings=...) so no array is ever materialised whole
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from c2 import model as model_lib
from c2.model.config import ModelConfig


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any


def make_init_fn(cfg: ModelConfig, tx: optax.GradientTransformation):
  """rng -> TrainState, traceable (for eval_shape and jit)."""
  def init(rng):
    params = nn.meta.unbox(model_lib.build(cfg).init(rng, jnp.zeros((1, 2), jnp.int32))["params"])
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return init


def abstract_state(cfg: ModelConfig, tx: optax.GradientTransformation) -> TrainState:
  return jax.eval_shape(make_init_fn(cfg, tx), jax.random.key(0))


def state_shardings(cfg: ModelConfig, tx: optax.GradientTransformation,
                    mesh: jax.sharding.Mesh, abstract: Optional[TrainState] = None) -> TrainState:
  """Params follow the logical rules; each optimizer leaf takes the sharding of the parameter
  whose shape it has (Adam moments, Muon momentum), anything else is replicated. `abstract`:
  abstract_state(cfg, tx) when the caller has it already."""
  abstract = abstract_state(cfg, tx) if abstract is None else abstract
  param_shardings = model_lib.param_shardings(cfg, mesh)
  replicated = NamedSharding(mesh, P())

  flat_params = jax.tree_util.tree_flatten_with_path(abstract.params)[0]
  param_by_path = {jax.tree_util.keystr(path): (leaf.shape, sharding) for (path, leaf), sharding
                   in zip(flat_params, jax.tree.leaves(param_shardings))}

  def pick(path, leaf):
    # optax states embed the param tree, so a moment's path ends with its parameter's path.
    key = jax.tree_util.keystr(path)
    for param_path, (shape, sharding) in param_by_path.items():
      if key.endswith(param_path) and tuple(leaf.shape) == tuple(shape):
        return sharding
    return replicated

  return TrainState(step=replicated, params=param_shardings,
                    opt_state=jax.tree_util.tree_map_with_path(pick, abstract.opt_state))


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, rng: jax.Array,
               shardings: TrainState) -> TrainState:
  return jax.jit(make_init_fn(cfg, tx), out_shardings=shardings)(rng)
