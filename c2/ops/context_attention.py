"""Context-parallel MLA attention over the mesh axes that shard `length` (the `context` role).

Glossary: B batch, T whole row, U local rows (T / P), P context shards, Z chunk (T / 2P),
H heads (local), N nope dim, R rope dim, K = N + R query/key head dim, J value head dim,
X = N + J (kv_b's output per head), L kv_lora_rank, Q query sub-block, C key/value sub-block.

Two strategies (ModelConfig.context_parallel):

  latent_all_gather  Composer 2's: every shard all-gathers the *latents* [B, U, L + R] =
      [normed c_kv | roped k_rope] of the row (576 numbers per token at full scale, against
      64 x 320 per-head K/V numbers: ~36x fewer bytes than Ulysses moves), then attends its local
      queries to them, applying the KV up-projection (c_kv @ kv_b -> k_nope, v) one key block at
      a time inside the loop: per-head K/V of the whole row never exist, only [B, C, H, K + J].
      The model computes the latents before the Q projection, and the gather depends on nothing
      else, so the scheduler can overlap the two. Its transpose is a reduce-scatter of the
      latents' gradient (autodiff makes it: the gather stays outside the custom VJP).
  ulysses  all_to_all swaps sequence shards for head shards, attention over the whole row for
      H / P heads, all_to_all back (on TPU the model keeps splash's implicit version instead).

Both mask by position (same non-padding segment and q_position >= kv_position), so rows may be
permuted. The zig-zag layout (c2/data/zigzag.py) splits a row into 2P chunks and gives shard i
chunks i and 2P-1-i: its two query chunks need kv chunks 0..i and 0..2P-1-i, 2P + 1 (query
chunk, kv chunk) pairs on every shard - a static trip count, with the shard's indices computed
from `lax.axis_index` - so fully masked chunk pairs are never computed and every shard does the
same work. In natural order shard i needs 4i + 3 pairs: the loop runs the worst case 4P - 1 and
skips the rest with `lax.cond` (correct, unbalanced). Chunk-level skipping relies on documents
being contiguous and increasing in the natural row (packing guarantees it); inside a pair, tiles
whose position mask is empty are skipped like in c2/ops/blockwise_attention.py.

The online softmax carries (max, sum, output) per query row across pairs, which merges the
partial results in log-sum-exp form; the custom VJP recomputes each key block's up-projection
and accumulates dq, d_latents (gathered row) and d_kv_b. Memory: a few [B, H, Q, C] float32
tiles and one key block's per-head K/V, never a [T, T] array.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from c2.ops.blockwise_attention import block_mask, online_softmax_step, tied_to, tile_grads
from c2.ops.splash_attention import KERNEL_OUTPUTS
from c2.parallel.sharding import logical_to_spec

LAYOUTS = ("natural", "zigzag")
STRATEGIES = ("latent_all_gather", "ulysses")
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_F32 = jnp.float32


# ----------------------------------------------------------------------------- the plan


def zigzag_slot(chunk, num_shards: int):
  """Natural chunk index -> its slot in the zig-zag row (shard s holds slots 2s and 2s + 1)."""
  return jnp.where(chunk < num_shards, 2 * chunk, 2 * (2 * num_shards - 1 - chunk) + 1)


def chunk_pairs(layout: str, num_shards: int, shard) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The (query chunk, kv chunk) pairs shard `shard` (int or traced) computes.

  -> (q_slot [N] in {0, 1}: which of the shard's two local chunks; kv_slot [N]: the chunk's slot
  in the gathered row; valid [N] bool). N = 2P + 1 (zigzag, all valid) or 4P - 1 (natural).
  """
  if layout not in LAYOUTS:
    raise ValueError(f"sequence layout {layout!r}; choose one of {LAYOUTS}")
  p = num_shards
  if layout == "zigzag":
    pair = jnp.arange(2 * p + 1)
    first = pair <= shard  # chunk `shard` attends to chunks 0..shard
    kv_chunk = jnp.where(first, pair, pair - shard - 1)  # chunk 2P-1-shard: 0..2P-1-shard
    return (jnp.where(first, 0, 1).astype(jnp.int32),
            zigzag_slot(kv_chunk, p).astype(jnp.int32), jnp.ones_like(pair, bool))
  kv_chunk = jnp.concatenate([jnp.arange(2 * p - 1), jnp.arange(2 * p)])
  q_slot = jnp.concatenate([jnp.zeros(2 * p - 1, jnp.int32), jnp.ones(2 * p, jnp.int32)])
  return q_slot, kv_chunk.astype(jnp.int32), kv_chunk <= 2 * shard + q_slot


# ------------------------------------------------------------------- the per-device core


def up_project(latents: jax.Array, kv_b: jax.Array, nope_dim: int) -> tuple[jax.Array, jax.Array]:
  """latents [B, C, L + R], kv_b [L, H, X] -> k [B, C, H, K] (rope key shared by all heads),
  v [B, C, H, J]."""
  l = kv_b.shape[0]
  kv = jnp.einsum("BCL,LHX->BCHX", latents[..., :l], kv_b)
  k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
  rope = latents[..., None, l:]  # [B, C, 1, R]
  return jnp.concatenate([k_nope, jnp.broadcast_to(rope, k_nope.shape[:3] + rope.shape[-1:])],
                         axis=-1), v


def _blocks(x, size, axis=1):
  """Splits `axis` into blocks of `size` and moves the block index first."""
  shape = x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x, axis=1):
  """Inverse of `_blocks`: [N, ..., size, ...] -> [..., N * size, ...]."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _chunk(x, slot, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, slot * size, size, axis)


def _add_chunk(x, update, slot, size, axis=1):
  return jax.lax.dynamic_update_slice_in_dim(x, _chunk(x, slot, size, axis) + update,
                                             slot * size, axis)


def _forward(q, lat, kv_b, q_seg, q_pos, kv_seg, kv_pos, pairs, scale, nope_dim, chunk, block_q,
             block_kv):
  """-> (out [B, U, H, J] dtype of q, lse [B, H, U] float32)."""
  q, q_seg, q_pos, kv_seg, kv_pos, pairs = tied_to(q, q_seg, q_pos, kv_seg, kv_pos, pairs)
  b, u, h, _ = q.shape
  j = kv_b.shape[-1] - nope_dim

  def pair(carry, xs):
    q_slot, kv_slot, valid = xs

    def run(carry):
      m, l, acc = carry
      qs = [_blocks(_chunk(x, q_slot, chunk), block_q) for x in (q, q_seg, q_pos)]
      stats = tuple(_blocks(_chunk(x, q_slot, chunk, 2), block_q, 2) for x in (m, l, acc))
      kvs = [_blocks(_chunk(x, kv_slot, chunk), block_kv) for x in (lat, kv_seg, kv_pos)]

      def kv_block(stats, ys):
        lat_, kv_seg_, kv_pos_ = ys
        k_, v_ = up_project(lat_, kv_b, nope_dim)  # one key block's per-head K/V

        def q_block(_, zs):
          q_, q_seg_, q_pos_, m_, l_, acc_ = zs
          mask = block_mask(q_seg_, kv_seg_, q_pos_, kv_pos_, True)

          update = lambda state: online_softmax_step(state, q_, k_, v_, mask, scale)

          return None, jax.lax.cond(jnp.any(mask), update, lambda c: c, (m_, l_, acc_))

        _, stats = jax.lax.scan(q_block, None, (*qs, *stats))
        return tuple(stats), None

      stats, _ = jax.lax.scan(kv_block, stats, kvs)
      put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(x, _unblocks(new, 2),
                                                               q_slot * chunk, 2)
      return tuple(put(x, new) for x, new in zip(carry, stats))

    return jax.lax.cond(valid, run, lambda c: c, carry), None

  init = (jnp.full((b, h, u), _MASK_VALUE, _F32), jnp.zeros((b, h, u), _F32),
          jnp.zeros((b, h, u, j), _F32))
  (m, l, acc), _ = jax.lax.scan(pair, init, pairs)
  empty = l == 0  # padding rows: every tile skipped
  out = acc / jnp.where(empty, 1.0, l)[..., None]
  lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))  # exp(s - inf) = 0
  out = jnp.einsum("BHUJ->BUHJ", out)
  return jnp.where((q_seg != 0)[:, :, None, None], out, 0).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _latent_flash(q, lat, kv_b, q_seg, q_pos, kv_seg, kv_pos, pairs, scale, nope_dim, chunk,
                  block_q, block_kv):
  return _forward(q, lat, kv_b, q_seg, q_pos, kv_seg, kv_pos, pairs, scale, nope_dim, chunk,
                  block_q, block_kv)[0]


def _latent_flash_fwd(q, lat, kv_b, q_seg, q_pos, kv_seg, kv_pos, pairs, scale, nope_dim, chunk,
                      block_q, block_kv):
  out, lse = _forward(q, lat, kv_b, q_seg, q_pos, kv_seg, kv_pos, pairs, scale, nope_dim, chunk,
                      block_q, block_kv)
  # Named like splash's outputs, so the block's save_attention remat policy keeps them and the
  # backward never reruns this forward loop (c2/model/block.py).
  out, lse = checkpoint_name(out, KERNEL_OUTPUTS), checkpoint_name(lse, KERNEL_OUTPUTS)
  return out, (q, lat, kv_b, q_seg, q_pos, kv_seg, kv_pos, pairs, out, lse)


def _latent_flash_bwd(scale, nope_dim, chunk, block_q, block_kv, residuals, d_out):
  q, lat, kv_b, q_seg, q_pos, kv_seg, kv_pos, pairs, out, lse = residuals
  l_dim = kv_b.shape[0]
  d_out = jnp.where((q_seg != 0)[:, :, None, None], d_out, 0).astype(q.dtype)
  # delta_i = <dO_i, O_i>: the softmax-backward correction per row.
  delta = jnp.einsum("BUHJ,BUHJ->BHU", d_out.astype(_F32), out.astype(_F32))

  def pair(carry, xs):
    q_slot, kv_slot, valid = xs

    def run(carry):
      dq, dlat, dkv_b = carry
      qs = [_blocks(_chunk(x, q_slot, chunk), block_q) for x in (q, d_out, q_seg, q_pos)]
      rows = [_blocks(_chunk(x, q_slot, chunk, 2), block_q, 2) for x in (lse, delta)]
      kvs = [_blocks(_chunk(x, kv_slot, chunk), block_kv) for x in (lat, kv_seg, kv_pos)]

      def kv_block(acc, ys):
        dq_chunk, dkv_b = acc
        lat_, kv_seg_, kv_pos_ = ys
        k_, v_ = up_project(lat_, kv_b, nope_dim)  # recomputed, never saved

        def q_block(kv_acc, zs):
          q_, do_, q_seg_, q_pos_, lse_, delta_ = zs
          mask = block_mask(q_seg_, kv_seg_, q_pos_, kv_pos_, True)
          dq, dk, dv = tile_grads(q_, k_, v_, do_, lse_, delta_, mask, scale)
          return (kv_acc[0] + dk, kv_acc[1] + dv), dq

        init = (jnp.zeros(k_.shape, _F32), jnp.zeros(v_.shape, _F32))
        (dk, dv), dqs = jax.lax.scan(q_block, init, (*qs, *rows))
        # The up-projection's transpose, in float32: d_kv [B, C, H, X] -> d_c_kv, d_kv_b; the
        # rope key is shared by all heads, so its gradient is the sum over heads.
        d_kv = jnp.concatenate([dk[..., :nope_dim], dv], axis=-1)
        d_c = jnp.einsum("BCHX,LHX->BCL", d_kv, kv_b, preferred_element_type=_F32)
        d_rope = dk[..., nope_dim:].sum(axis=2)  # [B, C, R]
        dkv_b = dkv_b + jnp.einsum("BCL,BCHX->LHX", lat_[..., :l_dim], d_kv,
                                   preferred_element_type=_F32)
        return (dq_chunk + dqs, dkv_b), jnp.concatenate([d_c, d_rope], axis=-1)

      dq_chunk = jnp.zeros((chunk // block_q,) + qs[0].shape[1:], _F32)
      (dq_chunk, dkv_b), dlats = jax.lax.scan(kv_block, (dq_chunk, dkv_b), kvs)
      return (_add_chunk(dq, _unblocks(dq_chunk), q_slot, chunk),
              _add_chunk(dlat, _unblocks(dlats), kv_slot, chunk), dkv_b)

    return jax.lax.cond(valid, run, lambda c: c, carry), None

  init = (jnp.zeros(q.shape, _F32), jnp.zeros(lat.shape, _F32), jnp.zeros(kv_b.shape, _F32))
  (dq, dlat, dkv_b), _ = jax.lax.scan(pair, init, pairs)
  return (dq.astype(q.dtype), dlat.astype(lat.dtype), dkv_b.astype(kv_b.dtype),
          None, None, None, None, None)


_latent_flash.defvjp(_latent_flash_fwd, _latent_flash_bwd)


# ------------------------------------------------------------------------- the wrappers


def _context_specs(q_shape):
  """(spec of [B, T, H, K] activations, the mesh axes of `length` or None, their total size)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None, None, 1
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  spec = logical_to_spec(("batch", "length", "act_heads", None), q_shape, sizes)
  axes = spec[1]
  if axes is None:
    return spec, None, 1
  names = axes if isinstance(axes, tuple) else (axes,)
  return spec, axes, math.prod(sizes[a] for a in names)


def context_shards(seq_len: int) -> int:
  """How many shards the active mesh splits a row of `seq_len` tokens into (1: none)."""
  return _context_specs((1, seq_len, 1, 1))[2]


def _blocks_for(chunk: int, block: int) -> int:
  """A sub-block size that divides the chunk: gcd keeps power-of-two requests exact (chunks of
  real rows are multiples of 512) and never exceeds the request."""
  return math.gcd(chunk, block)


def latent_attention(q: jax.Array, latents: jax.Array, kv_b: jax.Array, *,
                     segment_ids: jax.Array, positions: jax.Array, scale: float, nope_dim: int,
                     layout: str = "zigzag", block_q: int = 512,
                     block_kv: int = 512) -> jax.Array:
  """All-gathers the latents over the context shards, then attends the local queries to them,
  up-projecting key blocks inside the loop.

  q [B, T, H, K] (roped), latents [B, T, L + R] = [normed c_kv | roped k_rope], kv_b [L, H, X],
  segment_ids / positions [B, T] -> [B, T, H, J] (dtype of q).
  layout: how the row is ordered ("zigzag": c2/data/zigzag.py for this many context shards;
  "natural"). T must divide into 2P chunks, and blocks are clipped to divisors of a chunk.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"sequence layout {layout!r}; choose one of {LAYOUTS}")
  spec, axes, p = _context_specs(q.shape)
  t = q.shape[1]
  if t % (2 * p):
    raise ValueError(f"latent context parallelism splits a row into 2 x {p} chunks; the length "
                     f"{t} is not a multiple of {2 * p}")
  chunk = t // (2 * p)
  static = dict(scale=float(scale), nope_dim=nope_dim, chunk=chunk,
                block_q=_blocks_for(chunk, block_q), block_kv=_blocks_for(chunk, block_kv))

  def local(q_, lat_, kv_b_, seg_, pos_):
    shard, lat_all, seg_all, pos_all = 0, lat_, seg_, pos_
    if axes is not None:
      shard = jax.lax.axis_index(axes)
      # The gather depends only on the latents, so the scheduler may start it before the Q
      # projection; outside the custom VJP, autodiff transposes it to a reduce-scatter.
      with jax.named_scope("context_all_gather"):
        lat_all, seg_all, pos_all = (jax.lax.all_gather(x, axes, axis=1, tiled=True)
                                     for x in (lat_, seg_, pos_))
    pairs = chunk_pairs(layout, p, shard)
    return _latent_flash(q_, lat_all, kv_b_, seg_, pos_, seg_all, pos_all, pairs,
                         static["scale"], nope_dim, chunk, static["block_q"], static["block_kv"])

  with jax.named_scope("latent_context_attention"):
    if spec is None:
      return local(q, latents, kv_b, segment_ids, positions)
    tokens = P(spec[0], spec[1])
    return jax.shard_map(
        local, in_specs=(spec, P(*tokens, None), P(None, spec[2], None), tokens, tokens),
        out_specs=spec, check_vma=False)(q, latents, kv_b, segment_ids, positions)


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array,
                      positions: jax.Array, scale: float, impl: str = "auto") -> jax.Array:
  """Ulysses context parallelism with the position mask: q, k [B, T, H, K], v [B, T, H, J],
  segment_ids / positions [B, T] -> [B, T, H, J]. Each shard's heads (after tensor
  parallelism) must divide by the context shards. `impl`: reference or blockwise (auto picks by
  length); the TPU splash path is the model's implicit Ulysses (c2/model/attention.py)."""
  from c2.ops.attention import attention  # pylint: disable=import-outside-toplevel
  spec, axes, p = _context_specs(q.shape)
  impl = "blockwise" if impl == "auto" and q.shape[1] > 2048 else impl
  impl = "reference" if impl == "auto" else impl
  run = functools.partial(attention, scale=scale, impl=impl)
  if axes is None:
    return run(q, k, v, segment_ids=segment_ids, positions=positions)

  def local(q_, k_, v_, seg_, pos_):
    if q_.shape[2] % p:
      raise ValueError(f"Ulysses context parallelism needs the local heads ({q_.shape[2]}) to "
                       f"divide by the {p} context shards")
    to_heads = lambda x: jax.lax.all_to_all(x, axes, 2, 1, tiled=True)  # [B,U,H,*] -> [B,T,H/P,*]
    with jax.named_scope("ulysses_all_to_all"):
      q_, k_, v_ = to_heads(q_), to_heads(k_), to_heads(v_)
      seg_, pos_ = (jax.lax.all_gather(x, axes, axis=1, tiled=True) for x in (seg_, pos_))
    out = run(q_, k_, v_, segment_ids=seg_, positions=pos_)
    with jax.named_scope("ulysses_all_to_all"):
      return jax.lax.all_to_all(out, axes, 1, 2, tiled=True)  # [B, T, H/P, J] -> [B, U, H, J]

  tokens = P(spec[0], spec[1])
  return jax.shard_map(local, in_specs=(spec, spec, spec, tokens, tokens),
                       out_specs=spec, check_vma=False)(q, k, v, segment_ids, positions)


