"""Group metadata for the grouped-matmul kernels: which (group, m-tile) pair each grid step visits.

Rows of lhs are sorted by group, so group g covers rows [start_g, end_g). With row tiles of `tm`
rows, a group touches the tiles first_g..last_g, and a tile straddling a group boundary is visited
once per group it holds. The kernels iterate over a flat list of such *work items*; item w reads
m-tile `m_tiles[w]` and group `group_ids[w]`, and only rows in [row_starts[w], row_ends[w]) count.

Two kernels need slightly different lists:
* gmm (out [M,N] by m-tile) skips empty groups and appends one *fill* item per m-tile past the
  last group, so rows that belong to no group are written as zeros (they hold row_starts ==
  row_ends == 0: nothing to compute, only a zero store).
* tgmm (out [G,K,N] by group) visits one item per empty group so that group's output is zeroed,
  and never visits the tiles past the last group.
In both, m_tiles is non-decreasing and group_ids is non-decreasing, so every output block is
visited in one consecutive run of grid steps (Pallas keeps it in VMEM between those steps).

Item count is at most m_tiles + G - 1 (each group boundary inside a tile adds one visit, and an
empty group replaces the boundary it would have added), which sizes the arrays statically; the
number actually used, `num_items`, is traced and becomes the kernel's dynamic grid extent.
Everything here is jnp and runs inside jit before the kernel (it is cheap: O(M/tm + G)).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupMetadata(NamedTuple):
  """Scalar-prefetched work list; each field is int32 [W] with W = m_tiles + G - 1."""
  group_ids: jax.Array
  m_tiles: jax.Array
  row_starts: jax.Array
  row_ends: jax.Array


def make_group_metadata(
    group_sizes: jax.Array, *, num_rows: int, tm: int, num_m_tiles: int, for_tgmm: bool
) -> tuple[GroupMetadata, jax.Array]:
  """Work list for `group_sizes` [G] int32 over `num_rows` real rows padded to num_m_tiles*tm.

  Groups are clamped to the real rows (a caller passing sum(group_sizes) > M loses the excess
  rows, as jax.lax.ragged_dot would). Returns (metadata, num_items) with num_items int32 [].
  """
  num_groups = group_sizes.shape[0]
  max_items = num_m_tiles + num_groups - 1
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  nonempty = ends > starts

  first_tile = jnp.minimum(starts // tm, num_m_tiles - 1)
  last_tile = (ends - 1) // tm
  empty_visits = 1 if for_tgmm else 0
  span = jnp.where(nonempty, last_tile - first_tile + 1, empty_visits)  # items per group, [G]
  item_offsets = jnp.cumsum(span) - span  # first item of each group, [G]
  num_group_items = jnp.sum(span)

  w = jnp.arange(max_items, dtype=jnp.int32)
  # repeat() pads past num_group_items with the last group; those slots become fill items.
  g = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), span, total_repeat_length=max_items)
  group_tile = first_tile[g] + (w - item_offsets[g])

  if for_tgmm:
    is_fill = jnp.zeros_like(w, dtype=bool)
    num_fill = 0
  else:
    first_unowned_tile = (ends[-1] + tm - 1) // tm  # tiles from here on hold no group rows
    is_fill = w >= num_group_items
    num_fill = num_m_tiles - first_unowned_tile
    group_tile = jnp.where(is_fill, first_unowned_tile + (w - num_group_items), group_tile)

  meta = GroupMetadata(
      group_ids=g,
      m_tiles=jnp.clip(group_tile, 0, num_m_tiles - 1),
      row_starts=jnp.where(is_fill, 0, starts[g]),
      row_ends=jnp.where(is_fill, 0, ends[g]),
  )
  return meta, (num_group_items + num_fill).astype(jnp.int32)
