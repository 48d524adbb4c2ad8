"""Pallas TPU kernels: grouped matmul (gmm) and transposed grouped matmul (tgmm).

Both iterate a scalar-prefetched work list (metadata.py): item w pairs an m-tile with a group.
The list lives in SMEM (pltpu.PrefetchScalarGridSpec) so the BlockSpec index maps can read it to
pick which lhs rows and which expert's rhs to DMA next; its used length is the dynamic grid extent.

  gmm:  grid (N tiles, items, K tiles). out[m-tile, n-tile] += lhs[m-tile, k] @ rhs[g, k, n].
        An out tile shared by two groups is visited by consecutive items; each stores only its
        own rows (masked), the first visit zeroes the tile, so rows in no group come out zero.
  tgmm: grid (K tiles, N tiles, items). out[g, k, n] += lhs[m-tile, k]^T @ grad[m-tile, n],
        rows outside the group masked to zero; consecutive items of one group accumulate, the
        last one stores, and an empty group's single item stores zeros.

Boundary items. An item whose group covers its whole row tile runs one [tm]-row dot. One that
covers only part of it (a group boundary falls inside the tile) runs the dot per slab of
`slab_rows_for(tm, mxu_side)` rows and skips the slabs holding none of its rows: with tm = 512
and a 128-wide MXU, a boundary costs one extra slab instead of one extra tile. For the full kimi-k2.5 step at
32k (24 experts and ~65k rows per device) whole-tile revisits were ~20% of the expert FLOPs.

Operands arrive in the low-precision storage format (HBM traffic stays at 8 or 4 bits per
element) and are dequantised in VMEM (operands.decode) before a BF16 MXU dot, except where the
generation's MXU takes the element type natively and the format has no block scales (fp8 on
TPU7x): then the stored values go to the MXU as they are. Row scales (fp8, nvfp4's per-row
second level) factor out of the contraction and are applied once to the float32 accumulator.
All accumulation is float32.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import operands, quant
from pallas_kernels.metadata import GroupMetadata


def mxu_rows(rows: int | None, padded_rows: int, slab_rows: int, num_groups: int) -> int:
  """Rows the MXU multiplies, for the cost estimate: the rows in groups (`rows`, default all)
  rounded up to slabs, plus one extra slab per group boundary (a slab shared by two groups is
  computed for each: `slab_is_live`)."""
  in_groups = padded_rows if rows is None else min(rows, padded_rows)
  return -(-in_groups // slab_rows) * slab_rows + (num_groups - 1) * slab_rows


def slab_rows_for(tm: int, mxu_side: int) -> int:
  """Rows per boundary slab: the MXU's side where it divides the row tile (a 384-row tile on a
  256-wide MXU takes 128-row slabs), the whole tile if that is smaller."""
  return math.gcd(tm, mxu_side)


def covers_tile(row_start, row_end, tile_start, tm: int):
  """Whether the item's rows [row_start, row_end) hold the whole tile [tile_start, +tm)."""
  return jnp.logical_and(row_start <= tile_start, row_end >= tile_start + tm)


def slab_is_live(row_start, row_end, slab_start, slab_rows: int):
  """Whether slab [slab_start, +slab_rows) holds any of the item's rows [row_start, row_end)."""
  return jnp.logical_and(row_start < slab_start + slab_rows, row_end > slab_start)


def _split_refs(refs, lhs: operands.KernelOperand, rhs: operands.KernelOperand):
  """Kernel refs arrive flat, None operands skipped; regroup them as (lhs, rhs, rest)."""
  refs = list(refs)
  take = lambda present: refs.pop(0) if present else None
  lhs_refs = [take(a is not None) for a in lhs]
  rhs_refs = [take(a is not None) for a in rhs]
  return lhs_refs, rhs_refs, refs


def _flat(*ops: operands.KernelOperand):
  return [a for op in ops for a in op if a is not None]


def _compiler_params(vmem_limit_bytes: int, semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes)


def gmm_call(meta: GroupMetadata, num_items: jax.Array, lhs: operands.KernelOperand,
             rhs: operands.KernelOperand, *, fmt: quant.Format, tiles: tuple[int, int, int],
             out_shape: tuple[int, int], out_dtype, mxu_dtype, packed: bool, interpret: bool,
             vmem_limit_bytes: int, mxu_side: int, cost_rows: int | None = None) -> jax.Array:
  """lhs [Mp, Kp] x rhs [G, Kp, Np] -> out [Mp, Np] (padded dims are tile multiples)."""
  tm, tk, tn = tiles
  mp, np_ = out_shape
  kp = rhs.values.shape[1] * (2 if packed else 1)
  tiles_k, tiles_n = kp // tk, np_ // tn
  tk_stored = tk // 2 if packed else tk
  direct = mxu_dtype == fmt.values_dtype  # bf16, or fp8 where e4m3 is MXU-native: no decode
  tkb = tk // fmt.block if fmt.block else 0
  slab = slab_rows_for(tm, mxu_side)

  def kernel(meta, *refs):
    (l_val, l_scale, l_row), (r_val, r_scale, r_row), (out, acc) = _split_refs(refs, lhs, rhs)
    w, k = pl.program_id(1), pl.program_id(2)
    row_start, row_end = meta.row_starts[w], meta.row_ends[w]
    tile_start = meta.m_tiles[w] * tm

    def lhs_rows(lo: int, rows: int):  # rows [lo, lo + rows) of the lhs tile, MXU-ready
      if direct:
        return l_val[lo:lo + rows, :]
      scale = None if l_scale is None else l_scale[lo:lo + rows, :]
      return operands.decode(l_val[lo:lo + rows, :], scale, fmt, axis=1,
                             packed=packed).astype(mxu_dtype)

    @pl.when(k == 0)
    def _zero_acc():
      acc[...] = jnp.zeros_like(acc)

    @pl.when(row_end > row_start)  # fill items only store zeros
    def _accumulate():
      if direct:
        b = r_val[...]
      else:
        b = operands.decode(r_val[...], None if r_scale is None else r_scale[...], fmt, axis=0,
                            packed=packed).astype(mxu_dtype)
      whole = covers_tile(row_start, row_end, tile_start, tm)

      @pl.when(whole)
      def _whole_tile():
        acc[...] += operands.mxu_dot(lhs_rows(0, tm), b)  # [tm,tk]x[tk,tn]

      for lo in range(0, tm, slab):  # a group boundary inside the tile: only the live slabs
        @pl.when(jnp.logical_and(jnp.logical_not(whole),
                                 slab_is_live(row_start, row_end, tile_start + lo, slab)))
        def _slab(lo=lo):
          acc[lo:lo + slab, :] += operands.mxu_dot(lhs_rows(lo, slab), b)  # [S,tk]x[tk,tn]

    @pl.when(k == tiles_k - 1)
    def _store():
      m_tile = meta.m_tiles[w]
      first_visit = jnp.logical_or(w == 0, m_tile != meta.m_tiles[jnp.maximum(w - 1, 0)])

      @pl.when(first_visit)
      def _zero_out():
        out[...] = jnp.zeros_like(out)

      result = acc[...]
      if l_row is not None:
        result = result * l_row[...]  # [tm, 1]
      if r_row is not None:
        result = result * r_row[...]  # [1, tn]
      rows = m_tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
      mine = jnp.logical_and(rows >= meta.row_starts[w], rows < meta.row_ends[w])
      out[...] = jnp.where(mine, result, out[...].astype(jnp.float32)).astype(out.dtype)

  # Index maps: grid point (n, w, k) plus the prefetched metadata.
  specs = [pl.BlockSpec((tm, tk_stored), lambda n, w, k, meta: (meta.m_tiles[w], k))]
  if lhs.scales is not None:  # [Kt, Mp, tkb]
    specs.append(pl.BlockSpec((None, tm, tkb), lambda n, w, k, meta: (k, meta.m_tiles[w], 0)))
  if lhs.row_scales is not None:  # [Mp, 1]
    specs.append(pl.BlockSpec((tm, 1), lambda n, w, k, meta: (meta.m_tiles[w], 0)))
  specs.append(pl.BlockSpec((None, tk_stored, tn),
                            lambda n, w, k, meta: (meta.group_ids[w], k, n)))
  if rhs.scales is not None:  # [G, Kt, tkb, Np]
    specs.append(pl.BlockSpec((None, None, tkb, tn),
                              lambda n, w, k, meta: (meta.group_ids[w], k, 0, n)))
  if rhs.row_scales is not None:  # [G, 1, Np]
    specs.append(pl.BlockSpec((None, 1, tn), lambda n, w, k, meta: (meta.group_ids[w], 0, n)))
  out_spec = pl.BlockSpec((tm, tn), lambda n, w, k, meta: (meta.m_tiles[w], n))

  inputs = _flat(lhs, rhs)
  # Upper bound on traffic: every item streams one lhs row tile per N tile and one expert's
  # [K, N] weights; a tile shared by two groups is read twice. Items <= m tiles + G - 1.
  max_items = meta.group_ids.shape[0]
  lhs_tile_bytes = sum(a.size * a.dtype.itemsize for a in _flat(lhs)) * tm // mp
  rhs_group_bytes = sum(a.size * a.dtype.itemsize for a in _flat(rhs)) // rhs.values.shape[0]
  cost = pl.CostEstimate(
      flops=2 * mxu_rows(cost_rows, mp, slab, rhs.values.shape[0]) * kp * np_, transcendentals=0,
      bytes_accessed=int(max_items * (lhs_tile_bytes * tiles_n + rhs_group_bytes)
                         + mp * np_ * jnp.dtype(out_dtype).itemsize))
  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(tiles_n, num_items, tiles_k),
          in_specs=specs,
          out_specs=out_spec,
          scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
      ),
      # Out tiles are revisited by consecutive items, so only the N axis may be split (megacore).
      compiler_params=_compiler_params(vmem_limit_bytes, ("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
      cost_estimate=cost,
      name=f"gmm_{fmt.name}",
  )
  return call(meta, *inputs)


def tgmm_call(meta: GroupMetadata, num_items: jax.Array, lhs: operands.KernelOperand,
              grad: operands.KernelOperand, *, fmt: quant.Format, tiles: tuple[int, int, int],
              num_groups: int, out_dtype, mxu_dtype, packed: bool, interpret: bool,
              vmem_limit_bytes: int, mxu_side: int, cost_rows: int | None = None) -> jax.Array:
  """lhs [Mp, Kp]^T x grad [Mp, Np] per group -> out [G, Kp, Np]."""
  tm, tk, tn = tiles
  slab = slab_rows_for(tm, mxu_side)
  kp, np_ = lhs.values.shape[1], grad.values.shape[1]
  mp = lhs.values.shape[0] * (2 if packed else 1)
  tiles_k, tiles_n = kp // tk, np_ // tn
  tm_stored = tm // 2 if packed else tm
  tmb = tm // fmt.block if fmt.block else 0
  max_items = meta.group_ids.shape[0]

  def kernel(meta, *refs):
    (l_val, l_scale, l_row), (g_val, g_scale, g_row), (out, acc) = _split_refs(refs, lhs, grad)
    w = pl.program_id(2)
    group = meta.group_ids[w]
    prev_group = meta.group_ids[jnp.maximum(w - 1, 0)]
    next_group = meta.group_ids[jnp.minimum(w + 1, max_items - 1)]
    is_last_item = w == pl.num_programs(2) - 1

    @pl.when(jnp.logical_or(w == 0, group != prev_group))
    def _zero_acc():
      acc[...] = jnp.zeros_like(acc)

    row_start, row_end = meta.row_starts[w], meta.row_ends[w]
    tile_start = meta.m_tiles[w] * tm

    @pl.when(row_end > row_start)  # an empty group's item only stores zeros
    def _accumulate():
      rows = tile_start + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
      mine = jnp.logical_and(rows >= row_start, rows < row_end)  # [tm, 1]
      # Mask both operands: the other group's rows may hold inf, and 0 * inf is nan. Decoding
      # needs the whole tile (block scales and packed codes run along its rows).
      a = jnp.where(mine, operands.decode(l_val[...], None if l_scale is None else l_scale[...],
                                          fmt, axis=0, packed=packed), 0.0)  # [tm, tk]
      b = jnp.where(mine, operands.decode(g_val[...], None if g_scale is None else g_scale[...],
                                          fmt, axis=0, packed=packed), 0.0)  # [tm, tn]
      # Transpose in float32 (Mosaic's best-supported transpose), then cast for the MXU; the
      # cast is exact (values came from mxu_dtype or are exact in bf16, see operands.py).
      slab_dot = lambda lo, rows: operands.mxu_dot(  # [tk,rows]x[rows,tn], rows contracted
          a[lo:lo + rows].T.astype(mxu_dtype), b[lo:lo + rows].astype(mxu_dtype))
      whole = covers_tile(row_start, row_end, tile_start, tm)

      @pl.when(whole)
      def _whole_tile():
        acc[...] += slab_dot(0, tm)

      for lo in range(0, tm, slab):  # a group boundary inside the tile: only the live slabs
        @pl.when(jnp.logical_and(jnp.logical_not(whole),
                                 slab_is_live(row_start, row_end, tile_start + lo, slab)))
        def _slab(lo=lo):
          acc[...] += slab_dot(lo, slab)

    @pl.when(jnp.logical_or(is_last_item, group != next_group))
    def _store():
      result = acc[...]
      if l_row is not None:
        result = result * l_row[...]  # [tk, 1]
      if g_row is not None:
        result = result * g_row[...]  # [1, tn]
      out[...] = result.astype(out.dtype)

  # Index maps: grid point (k, n, w) plus the prefetched metadata.
  specs = [pl.BlockSpec((tm_stored, tk), lambda k, n, w, meta: (meta.m_tiles[w], k))]
  if lhs.scales is not None:  # [Mt, tmb, Kp]
    specs.append(pl.BlockSpec((None, tmb, tk), lambda k, n, w, meta: (meta.m_tiles[w], 0, k)))
  if lhs.row_scales is not None:  # [Kp, 1]
    specs.append(pl.BlockSpec((tk, 1), lambda k, n, w, meta: (k, 0)))
  specs.append(pl.BlockSpec((tm_stored, tn), lambda k, n, w, meta: (meta.m_tiles[w], n)))
  if grad.scales is not None:  # [Mt, tmb, Np]
    specs.append(pl.BlockSpec((None, tmb, tn), lambda k, n, w, meta: (meta.m_tiles[w], 0, n)))
  if grad.row_scales is not None:  # [1, Np]
    specs.append(pl.BlockSpec((1, tn), lambda k, n, w, meta: (0, n)))
  out_spec = pl.BlockSpec((None, tk, tn), lambda k, n, w, meta: (meta.group_ids[w], k, n))

  inputs = _flat(lhs, grad)
  # Upper bound: each item streams its lhs row tile once per N tile and its grad row tile once
  # per K tile; each group's [K, N] output is written once.
  l_tile = sum(a.size * a.dtype.itemsize for a in _flat(lhs)) * tm // mp
  g_tile = sum(a.size * a.dtype.itemsize for a in _flat(grad)) * tm // mp
  cost = pl.CostEstimate(
      flops=2 * mxu_rows(cost_rows, mp, slab, num_groups) * kp * np_, transcendentals=0,
      bytes_accessed=int(max_items * (l_tile * tiles_n + g_tile * tiles_k)
                         + num_groups * kp * np_ * jnp.dtype(out_dtype).itemsize))
  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_groups, kp, np_), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(tiles_k, tiles_n, num_items),
          in_specs=specs,
          out_specs=out_spec,
          scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
      ),
      compiler_params=_compiler_params(vmem_limit_bytes, ("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      cost_estimate=cost,
      name=f"tgmm_{fmt.name}",
  )
  return call(meta, *inputs)
