"""MLA's latent KV cache and attention over it in the weight-absorbed form (decoding).

Glossary: B rows (cache slots in this call), T new tokens per row, S cache capacity, H heads,
L kv_lora_rank, R qk_rope_head_dim, N qk_nope_head_dim, J v_head_dim, C = L + R, Y layers.

Per token and layer the cache holds only what MLA compresses keys and values into: the normed
latent c_kv [L] and the rotated rope key k_rope [R] (576 values at full scale, 1/32 of expanded
K/V for 64 heads). Attention never expands them per head; it absorbs kv_b into the query and the
output instead (algorithms.md 4.2):
  W_uk, W_uv = kv_b[..., :N], kv_b[..., N:]                   [L, H, N], [L, H, J]
  q_lat  = q_nope @ W_uk^T                                    [B, T, H, L]
  score  = (q_lat . c_kv + q_rope . k_rope) * scale           [B, H, T, S]
  out    = (softmax(score) @ c_kv) @ W_uv                     [B, T, H, J]
which is the expanded form's function reassociated.

A call attends over two key sets with one softmax: the row's cached tokens (positions below
`lengths`) and the call's own new tokens (causal among themselves). Under a layer scan the new
entries are returned, not written: the caller scatters every layer's entries into the stack at
once, after the scan, so the cache is only read inside the scan and updated in place outside it.
With one array per layer the layer writes its own first (`LayerCacheView.write_through`).
"""
from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from c2.ops.attention import _MASK_VALUE


@flax.struct.dataclass
class LayerCacheView:
  """What one attention layer sees of the cache for this call's rows."""

  kv: jax.Array  # [B, S, C] cached [c_kv | k_rope] of earlier tokens
  lengths: jax.Array  # [B] int32: tokens already cached per row; new token t sits at lengths + t
  # The layer writes its new entries into `kv` before reading it and returns the written array
  # (aux "kv_layer") instead of the entries ("kv_entries"). For a layer's own array of every
  # slot (decoding, layers unrolled): the reads then depend on the write, so XLA updates the
  # donated cache in place, where a scatter after the layer (reads and write unordered) made
  # XLA:CPU copy that layer's whole cache twice per step. Reading the written array is exact:
  # the cached key set is masked to positions below `lengths`, and writes land at or after it.
  write_through: bool = flax.struct.field(pytree_node=False, default=False)
  # Ascending key-set sizes ending with S (`windows`): attend over the first one that holds
  # every row's cached tokens. Empty: all S.
  windows: tuple = flax.struct.field(pytree_node=False, default=())


def window_sizes(capacity: int, count: int) -> tuple:
  """`count` nested prefix sizes of a cache of `capacity` tokens: capacity / 2^k, ascending,
  rounded up to multiples of 8 (a single window, the whole cache, for count <= 1)."""
  sizes = {capacity}
  for k in range(1, max(count, 1)):
    size = -(-(capacity >> k) // 8) * 8
    if size >= 8:
      sizes.add(min(size, capacity))
  return tuple(sorted(sizes))


def absorbed_attention(q_nope: jax.Array, q_rope: jax.Array, new_latent: jax.Array,
                       new_rope_key: jax.Array, kv_b: jax.Array, cache: LayerCacheView, *,
                       scale: float, new_valid: jax.Array) -> jax.Array:
  """Attention of T new queries over cached + new keys, without expanding per-head K/V.

  q_nope [B, T, H, N], q_rope [B, T, H, R] (rotated), new_latent [B, T, L] (normed),
  new_rope_key [B, T, R] (rotated), kv_b [L, H, N + J], new_valid [B, T] bool (False: padding,
  neither a query that matters nor a key) -> [B, T, H, J] in the dtype of q_nope.
  """
  n, l = q_nope.shape[-1], new_latent.shape[-1]
  w_uk, w_uv = kv_b[..., :n], kv_b[..., n:]  # [L, H, N], [L, H, J]
  f32 = jnp.float32
  q_lat = jnp.einsum("BTHN,LHN->BTHL", q_nope, w_uk, preferred_element_type=f32)
  # Queries and keys over the whole entry [latent | rope key] (C = L + R): one product per key
  # set reads the cache as stored, where splitting it made XLA copy both halves of every layer's
  # cache each step. The values' product runs over C too (R/L more FLOPs) and keeps its first L.
  q = jnp.concatenate([q_lat, q_rope.astype(f32)], axis=-1)  # [B, T, H, C]
  new_entries = jnp.concatenate([new_latent, new_rope_key.astype(new_latent.dtype)], -1)  # [B, T, C]
  scores = lambda keys: jnp.einsum("BTHC,BSC->BHTS", q, keys.astype(f32)) * scale

  t = q_nope.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]  # [T, T]
  new_visible = causal[None] & new_valid[:, None, :]  # [B, T, T]
  new = jnp.where(new_visible[:, None], scores(new_entries), _MASK_VALUE)

  def attend(kv: jax.Array) -> jax.Array:
    """Over kv [B, S', C], the cache's first S' positions (all of them cached below S')."""
    s = kv.shape[1]
    old_visible = jnp.arange(s)[None, :] < cache.lengths[:, None]  # [B, S']
    old = jnp.where(old_visible[:, None, None, :], scores(kv), _MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([old, new], axis=-1), axis=-1)  # [B, H, T, S' + T]
    # [B, H, T, C] is the product's natural layout; asking XLA:CPU for [B, T, H, C] directly
    # made it run the product as an unfused dot with the cache transposed (measured 180 vs 32
    # us per layer at B = 16 decode rows, 20 vs 12 at B = 1); the small result's transpose is
    # cheap.
    return (jnp.einsum("BHTS,BSC->BHTC", probs[..., :s], kv.astype(f32)) +
            jnp.einsum("BHTS,BSC->BHTC", probs[..., s:], new_entries.astype(f32)))

  if len(cache.windows) > 1:
    # Measured on CPU, 8 decode rows of capacity 1,536 at 100 cached tokens: see
    # ModelConfig.cache_windows and the README's engine section.
    index = jnp.sum(jnp.asarray(cache.windows[:-1]) < jnp.max(cache.lengths))
    out_entry = jax.lax.switch(index, [lambda w=w: attend(cache.kv[:, :w])
                                       for w in cache.windows])
  else:
    out_entry = attend(cache.kv)
  out_lat = out_entry[..., :l].transpose(0, 2, 1, 3)  # [B, T, H, L]
  out = jnp.einsum("BTHL,LHJ->BTHJ", out_lat.astype(q_nope.dtype), w_uv,
                   preferred_element_type=f32)
  return out.astype(q_nope.dtype)


def write_entries(stack: jax.Array, rows: Optional[jax.Array], lengths: jax.Array,
                  entries: jax.Array, valid: jax.Array) -> jax.Array:
  """Scatters new [c_kv | k_rope] entries of every layer into the stacked cache, in one scatter
  (in place under jit when the cache is donated).

  stack [Y, slots, S, C]; rows [B] slot ids (None: every slot, B = slots); entries [Y, B, T, C]
  for positions lengths + t; padding (valid [B, T] False) and positions past S are dropped,
  never wrapped.
  """
  _, b, t, _ = entries.shape
  s = stack.shape[2]
  if rows is None:
    rows = jnp.arange(b)
  positions = lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
  positions = jnp.where(valid, positions, s)  # out of bounds: dropped
  return stack.at[:, rows[:, None], positions].set(entries.astype(stack.dtype), mode="drop")


def read_rows(stack: jax.Array, layer: jax.Array | int, rows: Optional[jax.Array]) -> jax.Array:
  """stack [Y, slots, S, C] -> [B, S, C]: one layer's cache for this call's rows (None: all)."""
  layer_cache = jax.lax.dynamic_index_in_dim(stack, layer, axis=0, keepdims=False)
  return layer_cache if rows is None else layer_cache[rows]
