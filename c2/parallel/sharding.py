"""Logical axis names, the one table that maps them to mesh axes, and sharding reports.

Model code names every dimension with a logical name from this vocabulary; `RULES` decides which
mesh axes shard it. Changing a parallelism layout means editing this table, never the model.

Activations:
  batch       sequences in a batch                  -> data, fsdp, expert
  length      positions in a sequence               -> context (attention then runs in
              c2/ops/context_attention.py: latent all-gather over these axes, or Ulysses)
  act_embed   model width of activations            -> (replicated)
  act_heads   attention heads of activations        -> tensor
  kernel_heads  heads inside the attention kernel   -> tensor, context (the kernel needs whole
              sequences, so the context axis splits heads there instead: an all-to-all swaps
              sequence shards for head shards and back, Ulysses-style context parallelism)
  act_mlp     FFN hidden units of activations       -> tensor
  act_vocab   vocabulary logits                     -> tensor
Parameters:
  embed       model width of weights                -> fsdp, expert, context (ZeRO-3 style:
              the expert and context axes also split the batch, so they shard weights too)
  q_lora, kv_lora  the latent input dims of q_b/kv_b -> fsdp, expert, context
  vocab       vocabulary rows / columns             -> tensor
  heads       attention heads                       -> tensor
  mlp         dense FFN hidden units                -> tensor
  experts     routed experts                        -> expert
  expert_mlp  expert FFN hidden units               -> tensor
  head_dim, layers, norm                            -> (replicated)

A mesh axis is used at most once per array, and an axis that does not divide the dimension is
dropped (the dimension stays replicated along it); c2/parallel/report.py makes both visible.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "length": ("context",),
    "act_embed": (),
    "act_heads": ("tensor",),
    "kernel_heads": ("tensor", "context"),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "embed": ("fsdp", "expert", "context"),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    "q_lora": ("fsdp", "expert", "context"),
    "kv_lora": ("fsdp", "expert", "context"),
    "head_dim": (),
    "layers": (),
    "norm": (),
}


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int],
                    axis_sizes: Mapping[str, int], rules: Mapping[str, tuple[str, ...]] = RULES) -> P:
  """Maps logical dimension names to a PartitionSpec valid for `shape` on a mesh of `axis_sizes`."""
  if len(names) != len(shape):
    raise ValueError(f"logical names {tuple(names)} do not match rank of shape {tuple(shape)}")
  used: set[str] = set()
  spec = []
  for name, dim in zip(names, shape):
    if name is None:
      spec.append(None)
      continue
    if name not in rules:
      raise KeyError(f"logical axis {name!r} has no rule; add it to c2.parallel.sharding.RULES")
    axes = [a for a in rules[name] if a in axis_sizes and axis_sizes[a] > 1 and a not in used]
    while axes and dim % math.prod(axis_sizes[a] for a in axes):
      axes.pop()  # Drop the innermost axis until the dimension divides evenly.
    used.update(axes)
    spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
  return P(*spec)


def _active_axis_sizes() -> dict[str, int] | None:
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  return dict(zip(mesh.axis_names, mesh.axis_sizes))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Sharding constraint by logical names; a no-op when no mesh is set (single-device runs)."""
  axis_sizes = _active_axis_sizes()
  if axis_sizes is None:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, axis_sizes))


def param_specs(boxed_abstract_params: Any, mesh: jax.sharding.Mesh) -> Any:
  """PartitionSpecs for a tree of `nn.LogicallyPartitioned` (as from `jax.eval_shape(init)`)."""
  axis_sizes = dict(mesh.shape)

  def one(leaf):
    if isinstance(leaf, nn.LogicallyPartitioned):
      return logical_to_spec(leaf.names, leaf.value.shape, axis_sizes)
    return P()

  return jax.tree.map(one, boxed_abstract_params,
                      is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def named_shardings(specs: Any, mesh: jax.sharding.Mesh) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `abstract` carrying the matching leaf of `shardings`: the argument
  specs for lowering, restoring or initialising straight into shards."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)
