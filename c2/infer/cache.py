"""The engine's device state: slotted latent KV caches plus the speculative drafter's carry.

Glossary: Y layers of a stack, N slots (one sequence each), S slot capacity in tokens,
C = kv_lora_rank + qk_rope_head_dim, W = draft depth + 1, D model width.

A slot holds one sequence; sequences of any length share a batch because every row carries its
own `lengths` and attention masks keys at or past it. Finishing a sequence frees its slot; the next
request's prefill starts it at length 0 (old entries are masked, then overwritten). Per token and
layer the cache holds C values (576 at full scale: 1,152 bytes in bf16).

The MTP drafter has a cache of its own (one layer per MTP module) that lags the trunk: MTP at
position t needs token t + 1, so positions whose next token was only just sampled wait in
`pending_hidden`/`pending_tokens` (the trunk's hidden state there, and that next token) until the
next speculative step folds them in.
"""
from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from c2.model.config import ModelConfig
from c2.parallel import sharding

# Logical axes of a cache stack [Y, N, S, C] and of the per-slot vectors.
STACK_AXES = ("layers", "batch", "length", None)
SLOT_AXES = ("batch",)


@flax.struct.dataclass
class EngineCache:
  # {"dense": [Yd, N, S, C], "moe": [Ym, N, S, C], "mtp": [M, N, S, C]} (absent: empty); with
  # unrolled layers "dense" and "moe" are tuples of per-layer [N, S, C] arrays.
  stacks: dict
  lengths: jax.Array  # [N] int32 tokens in the trunk cache
  mtp_lengths: jax.Array  # [N] int32 positions in the MTP cache
  pending_hidden: jax.Array  # [N, W, D] trunk pre-norm hidden at positions mtp_lengths + w
  pending_tokens: jax.Array  # [N, W] int32: the token after each of those positions
  pending_count: jax.Array  # [N] int32 (= lengths - mtp_lengths)

  @property
  def trunk_stacks(self) -> dict:
    return {name: self.stacks[name] for name in ("dense", "moe") if name in self.stacks}


def entry_size(cfg: ModelConfig) -> int:
  return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def bytes_per_token(cfg: ModelConfig, dtype) -> int:
  """Trunk cache bytes per token over all layers (MTP caches add mtp_depth more layers)."""
  return cfg.num_layers * entry_size(cfg) * jnp.dtype(dtype).itemsize


def _shapes(cfg: ModelConfig, slots: int, capacity: int, draft_depth: int, dtype) -> EngineCache:
  c = entry_size(cfg)
  stack = lambda layers: jax.ShapeDtypeStruct((layers, slots, capacity, c), jnp.dtype(dtype))
  # Unrolled layers (ModelConfig.scan_layers False) get one array per layer: a layer then reads
  # its cache as stored, where slicing it out of a stack is a copy per layer and step on CPU.
  trunk = stack if cfg.scan_layers else lambda layers: tuple(
      jax.ShapeDtypeStruct((slots, capacity, c), jnp.dtype(dtype)) for _ in range(layers))
  stacks = {}
  if cfg.first_k_dense:
    stacks["dense"] = trunk(cfg.first_k_dense)
  if cfg.num_moe_layers:
    stacks["moe"] = trunk(cfg.num_moe_layers)
  if draft_depth:
    stacks["mtp"] = stack(cfg.mtp_depth)
  w = draft_depth + 1
  vector = jax.ShapeDtypeStruct((slots,), jnp.int32)
  return EngineCache(
      stacks=stacks, lengths=vector, mtp_lengths=vector,
      pending_hidden=jax.ShapeDtypeStruct((slots, w, cfg.hidden_size), jnp.dtype(cfg.dtype)),
      pending_tokens=jax.ShapeDtypeStruct((slots, w), jnp.int32), pending_count=vector)


def cache_shardings(abstract: EngineCache, mesh: jax.sharding.Mesh) -> EngineCache:
  sizes = dict(mesh.shape)

  def one(names):
    return lambda leaf: jax.sharding.NamedSharding(
        mesh, sharding.logical_to_spec(names[-leaf.ndim:], leaf.shape, sizes))

  return abstract.replace(
      stacks=jax.tree.map(one(STACK_AXES), abstract.stacks),  # [Y, N, S, C] or per layer [N, S, C]
      lengths=one(SLOT_AXES)(abstract.lengths), mtp_lengths=one(SLOT_AXES)(abstract.mtp_lengths),
      pending_hidden=one(("batch", None, None))(abstract.pending_hidden),
      pending_tokens=one(("batch", None))(abstract.pending_tokens),
      pending_count=one(SLOT_AXES)(abstract.pending_count))


def abstract_cache(cfg: ModelConfig, slots: int, capacity: int, draft_depth: int = 0,
                   dtype=None, mesh: Optional[jax.sharding.Mesh] = None) -> EngineCache:
  """ShapeDtypeStructs of the cache (with shardings when a mesh is given): for AOT lowering."""
  shapes = _shapes(cfg, slots, capacity, draft_depth, dtype or cfg.dtype)
  if mesh is None:
    return shapes
  return sharding.with_shardings(shapes, cache_shardings(shapes, mesh))


def allocate(cfg: ModelConfig, slots: int, capacity: int, draft_depth: int = 0, dtype=None,
             mesh: Optional[jax.sharding.Mesh] = None) -> EngineCache:
  """An empty cache, created directly in its shards when a mesh is given."""
  shapes = _shapes(cfg, slots, capacity, draft_depth, dtype or cfg.dtype)
  zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  if mesh is None:
    return jax.jit(zeros)()
  return jax.jit(zeros, out_shardings=cache_shardings(shapes, mesh))()
