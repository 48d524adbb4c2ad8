"""Context-parallel MLA attention (c2/ops/context_attention.py) against the dense reference.

On the 8-device CPU mesh, with packed rows whose documents cross chunk borders, padding, and
the zig-zag permutation (c2/data/zigzag.py): forward and gradients wrt q, latents and kv_b of the
latent all-gather path and of the Ulysses path equal c2.ops.attention.dot_product_attention on
the natural-order row. float32, tolerance 1e-5 relative to each array's max: the paths differ
from the reference only in summation order.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2.data import zigzag
from c2.ops import context_attention as ca
from c2.ops.attention import attention
from c2.parallel.mesh import make_mesh
from tests.hlo_arrays import largest_arrays
from tests.packed_rows import packed_rows

B, T, H, N, R, J, L = 2, 64, 4, 8, 4, 8, 16
SCALE = 0.3
DOCS = ([5, 20, 9, 19, 3], [64])  # row 0 ends in 8 padding tokens; row 1 is one document


def _packed():
  return packed_rows(DOCS, T)


def _inputs(seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (B, T, H, N + R))
  lat = jax.random.normal(keys[1], (B, T, L + R))
  kv_b = 0.3 * jax.random.normal(keys[2], (L, H, N + J))
  w = jax.random.normal(keys[3], (B, T, H, J))  # cotangent direction
  return q, lat, kv_b, w


def _reference(q, lat, kv_b, seg):
  k, v = ca.up_project(lat, kv_b, N)
  return attention(q, k, v, scale=SCALE, segment_ids=jnp.asarray(seg), impl="reference")


def _value_and_grads(fn, w):
  loss = lambda *args: jnp.sum(fn(*args) * w)
  return lambda *args: (fn(*args), jax.grad(loss, argnums=(0, 1, 2))(*args))


def _assert_close(got, want, what):
  err = float(jnp.max(jnp.abs(got - want)))
  scale = float(jnp.max(jnp.abs(want)))
  assert err <= 1e-5 * scale + 1e-6, f"{what}: max error {err:.3g} (max {scale:.3g})"
  return err


def _parallel(strategy, layout, mesh_axes):
  """The op under a mesh, on rows in `layout`, as a function of natural-order inputs."""
  mesh = make_mesh(mesh_axes)
  shards = mesh_axes["context"]
  seg, pos = _packed()
  to = (lambda x: zigzag.to_zigzag(x, shards)) if layout == "zigzag" else (lambda x: x)
  back = (lambda x: jnp.take(x, zigzag.inverse_permutation(T, shards), axis=1)
          if layout == "zigzag" else x)
  perm = zigzag.permutation(T, shards) if layout == "zigzag" else np.arange(T)
  seg_l, pos_l = jnp.asarray(to(seg)), jnp.asarray(to(pos))

  def run(q, lat, kv_b):
    q, lat = jnp.take(q, perm, axis=1), jnp.take(lat, perm, axis=1)
    if strategy == "latent_all_gather":
      out = ca.latent_attention(q, lat, kv_b, segment_ids=seg_l, positions=pos_l,
                                scale=SCALE, nope_dim=N, layout=layout, block_q=4, block_kv=4)
    else:
      k, v = ca.up_project(lat, kv_b, N)
      out = ca.ulysses_attention(q, k, v, segment_ids=seg_l, positions=pos_l, scale=SCALE,
                                 impl="blockwise")
    out = jnp.where((seg_l != 0)[:, :, None, None], out, 0)
    return back(out)

  return mesh, run


@pytest.mark.parametrize("strategy,layout,mesh_axes", [
    ("latent_all_gather", "zigzag", {"context": 4, "fsdp": 2}),
    pytest.param("latent_all_gather", "zigzag", {"context": 8}, marks=pytest.mark.slow),
    ("latent_all_gather", "natural", {"context": 4, "fsdp": 2}),
    ("ulysses", "zigzag", {"context": 4, "fsdp": 2}),
])
def test_matches_reference(strategy, layout, mesh_axes):
  q, lat, kv_b, w = _inputs()
  seg, _ = _packed()
  want, want_grads = _value_and_grads(lambda *a: _reference(*a, seg), w)(q, lat, kv_b)
  mesh, run = _parallel(strategy, layout, mesh_axes)
  with jax.set_mesh(mesh):
    got, got_grads = jax.jit(_value_and_grads(run, w))(q, lat, kv_b)
  errors = [_assert_close(got, want, "out")]
  for name, g, ref in zip(("dq", "d_latents", "d_kv_b"), got_grads, want_grads):
    assert float(jnp.max(jnp.abs(ref))) > 0, name  # each gradient is exercised
    errors.append(_assert_close(g, ref, name))
  print(f"{strategy}/{layout}/{mesh_axes}: max errors out, dq, dlat, dkv_b = {errors}")


def test_single_device_matches_reference():
  """Without a mesh the latent op is one shard in natural order (blocks smaller than chunks)."""
  q, lat, kv_b, w = _inputs(1)
  seg, pos = _packed()
  want, want_grads = _value_and_grads(lambda *a: _reference(*a, seg), w)(q, lat, kv_b)
  run = lambda q, lat, kv_b: ca.latent_attention(
      q, lat, kv_b, segment_ids=jnp.asarray(seg),
      positions=jnp.asarray(pos), scale=SCALE, nope_dim=N, layout="natural", block_q=8,
      block_kv=4)
  got, got_grads = jax.jit(_value_and_grads(run, w))(q, lat, kv_b)
  _assert_close(got, want, "out")
  for name, g, ref in zip(("dq", "d_latents", "d_kv_b"), got_grads, want_grads):
    _assert_close(g, ref, name)


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_zigzag_plan_covers_the_causal_chunk_pairs_once(shards):
  """Shard i computes exactly the causal (query chunk, kv chunk) pairs of its two chunks."""
  perm_chunks = zigzag.permutation(2 * shards, shards)  # chunk order of the zig-zag row
  for shard in range(shards):
    q_slot, kv_slot, valid = (np.asarray(a) for a in ca.chunk_pairs("zigzag", shards, shard))
    assert len(q_slot) == 2 * shards + 1 and valid.all()
    got = sorted((int(perm_chunks[2 * shard + a]), int(perm_chunks[c]))
                 for a, c in zip(q_slot, kv_slot))
    mine = (shard, 2 * shards - 1 - shard)
    assert got == sorted((qc, kc) for qc in mine for kc in range(qc + 1))
    q_slot, kv_slot, valid = (np.asarray(a) for a in ca.chunk_pairs("natural", shards, shard))
    got = sorted((2 * shard + int(a), int(c)) for a, c, v in zip(q_slot, kv_slot, valid) if v)
    assert got == sorted((qc, kc) for qc in (2 * shard, 2 * shard + 1) for kc in range(qc + 1))


def test_latent_path_never_holds_whole_row_scores_or_kv():
  """The compiled latent path at T = 256 on context=4 holds no [.., T, T] array, no per-head
  K/V of the whole gathered row and no [.., T, T/P] score slab: only chunk-sized tiles."""
  t, h = 256, 4
  mesh = make_mesh({"context": 4, "fsdp": 2})
  seg = jnp.ones((B, t), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))

  def loss(q, lat, kv_b):
    return jnp.sum(ca.latent_attention(q, lat, kv_b, segment_ids=seg, positions=pos,
                                       scale=SCALE, nope_dim=N, layout="zigzag",
                                       block_q=16, block_kv=16) ** 2)

  args = (jax.ShapeDtypeStruct((B, t, h, N + R), jnp.float32),
          jax.ShapeDtypeStruct((B, t, L + R), jnp.float32),
          jax.ShapeDtypeStruct((L, h, N + J), jnp.float32))
  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
  shapes = [tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"f32\[([\d,]*)\]", hlo)]
  assert shapes, "no float32 shapes found in the HLO"
  for shape in shapes:
    assert sum(d >= t // 4 for d in shape) <= 1, f"a whole-row x row-slab array {shape}"
    per_head_row = len(shape) >= 3 and t in shape and h in shape[shape.index(t):]
    assert not per_head_row, f"per-head K/V or scores over the whole row: {shape}"
  assert "all-gather" in hlo and "reduce-scatter" in hlo  # the gather and its transpose


def test_latent_path_under_a_layer_scan_keeps_its_memory_per_tile():
  """The gradient through a scan over layers (as the model runs it) holds no stack of per-tile
  masks or scores: the segment ids and positions are the same in every layer, and without
  `tied_to` JAX's scan partial evaluation hoisted every tile's mask out of the layer loop
  (measured: [pairs, kv blocks, q blocks, B, H, Q, C], 63 GiB on the tiny model at 128k). Bound:
  nothing larger than the op's own [B, T, H, K] query."""
  t, h, block = 512, 4, 16
  mesh = make_mesh({"context": 4, "fsdp": 2})
  seg = jnp.ones((B, t), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))

  def loss(q, lat, kv_b):
    def layer(x, _):
      out = ca.latent_attention(x, lat, kv_b, segment_ids=seg, positions=pos, scale=SCALE,
                                nope_dim=N, layout="zigzag", block_q=block, block_kv=block)
      return x + jnp.mean(out, axis=-1, keepdims=True), None
    return jnp.sum(jax.lax.scan(layer, q, None, length=2)[0] ** 2)

  args = (jax.ShapeDtypeStruct((B, t, h, N + R), jnp.float32),
          jax.ShapeDtypeStruct((B, t, L + R), jnp.float32),
          jax.ShapeDtypeStruct((L, h, N + J), jnp.float32))
  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
  largest = largest_arrays(hlo)
  assert largest[0][0] <= B * t * h * (N + R), f"largest arrays {largest[:3]}"
