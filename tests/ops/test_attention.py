"""Attention implementations against the dense reference (c2.ops.attention.dot_product_attention).

Every impl computes causal attention inside packed segments and zeroes padding rows, so each is
compared with `attention(..., impl="reference")` on all rows, forward and VJP (q, k, v), with
random cotangents on every row (padding cotangents must be ignored).

Tolerances: float32 inputs agree to ~1e-6 absolute (the same float32 math in another order), so
2e-5 leaves margin; bfloat16 inputs differ by the rounding of the probabilities to bfloat16
before the value matmul (unnormalised in blockwise/splash, normalised in the reference), a few
bf16 ulps of outputs of size ~1, hence 3e-2. Splash runs in the Pallas interpreter here; on TPU
it is only compiled (AOT, marked tpu_aot), never run.
"""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import NamedSharding, PartitionSpec as P

from c2.parallel import mesh as meshlib
from c2.parallel.sharding import with_shardings
from c2.ops import attention as attn
from c2.ops import splash_attention as sa
from c2.ops.blockwise_attention import blockwise_attention
from tests.hlo_arrays import largest_arrays

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only TPU clients may coexist
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (jax[tpu] extra)")


def _inputs(b, t, h, k_dim, v_dim, segments, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  seg = jnp.asarray(np.array([np.repeat(ids, counts) for ids, counts in segments]), jnp.int32)
  assert seg.shape == (b, t)
  return (normal(b, t, h, k_dim), normal(b, t, h, k_dim), normal(b, t, h, v_dim), seg,
          normal(b, t, h, v_dim))


def _value_and_grads(fn, q, k, v, cotangent):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(cotangent))


def _reference(seg, scale):
  return lambda q, k, v: attn.attention(q, k, v, scale=scale, segment_ids=seg, impl="reference")


def _assert_close(got, want, tol):
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(g)), name
    np.testing.assert_allclose(g, w, atol=tol * max(1.0, np.abs(w).max()), rtol=tol, err_msg=name)


# Row 0: two documents then padding; row 1: one document then padding. Rows 64..76 are padding
# in both rows, so with block_q 32 the last query block is all padding (every key block skipped).
PACKED_77 = [([1, 2, 0], [30, 30, 17]), ([3, 0], [20, 57])]


@pytest.mark.parametrize("block_q,block_kv", [(32, 16), (512, 512)])
def test_blockwise_matches_reference_f32(block_q, block_kv):
  """T = 77 is a multiple of neither block; K = 24 != J = 16; packed, padded, causal."""
  q, k, v, seg, ct = _inputs(2, 77, 3, 24, 16, PACKED_77)
  fn = lambda q, k, v: blockwise_attention(q, k, v, scale=0.3, q_segment_ids=seg,
                                           kv_segment_ids=seg, block_q=block_q, block_kv=block_kv)
  got = jax.jit(lambda *a: _value_and_grads(fn, *a))(q, k, v, ct)
  want = jax.jit(lambda *a: _value_and_grads(_reference(seg, 0.3), *a))(q, k, v, ct)
  _assert_close(got, want, 2e-5)
  assert float(jnp.abs(got[0][:, 60:]).max()) == 0.0  # padding rows are zero


def test_blockwise_bf16_and_non_causal():
  q, k, v, seg, ct = _inputs(1, 48, 2, 32, 32, [([1, 2], [20, 28])], jnp.bfloat16, seed=1)
  causal = jax.jit(lambda *a: _value_and_grads(
      lambda q, k, v: attn.attention(q, k, v, scale=0.2, segment_ids=seg, impl="blockwise"), *a))
  want = jax.jit(lambda *a: _value_and_grads(_reference(seg, 0.2), *a))
  _assert_close(causal(q, k, v, ct), want(q, k, v, ct), 3e-2)
  full = blockwise_attention(q, k, v, scale=0.2, q_segment_ids=seg, kv_segment_ids=seg,
                             causal=False, block_q=16, block_kv=16)
  dense = attn.dot_product_attention(q, k, v, scale=0.2, q_segment_ids=seg, kv_segment_ids=seg,
                                     causal=False)
  np.testing.assert_allclose(np.asarray(full, np.float32), np.asarray(dense, np.float32),
                             atol=3e-2)


def test_auto_and_validation():
  assert attn.resolve_impl("auto", attn.dense_max_len("cpu")) == "reference"  # CPU, short rows
  assert attn.resolve_impl("auto", attn.dense_max_len("cpu") + 1) == "blockwise"
  assert attn.dense_max_len("cpu") == 256 and attn.dense_max_len("gpu") == 2048
  assert attn.resolve_impl("splash", 8) == "splash"
  with pytest.raises(ValueError, match="flash"):
    attn.resolve_impl("flash", 8)
  from c2.model.config import get_preset
  with pytest.raises(ValueError, match="attention_impl"):
    get_preset("tiny", attention_impl="flash")


@pytest.mark.parametrize("fused", [False, True], ids=["dq_and_dkv_kernels", "fused_backward"])
def test_splash_interpret_on_mesh_matches_reference(fused):
  """The kernel in the Pallas interpreter, inside shard_map on the fake 8-device CPU mesh
  (batch over fsdp, heads over tensor); T = 200 pads to 256, K 48 -> 64, J 32 -> 64."""
  q, k, v, seg, ct = _inputs(4, 200, 2, 48, 32, [([1, 2, 0], [90, 100, 10]), ([5], [200]),
                                                   ([1, 0], [30, 170]), ([7, 8], [1, 199])])
  blocks = sa.block_sizes(200, fused_backward=fused)
  assert (blocks.block_q, blocks.block_kv) == (256, 256)  # clipped to T rounded up to 128
  assert blocks.use_fused_bwd_kernel == fused
  fn = lambda q, k, v: jnp.where(
      (seg != 0)[:, :, None, None],
      sa.splash_attention(q, k, v, scale=0.25, segment_ids=seg, blocks=blocks, interpret=True), 0)
  with jax.set_mesh(meshlib.make_mesh({"fsdp": 4, "tensor": 2})):
    got = jax.jit(lambda *a: _value_and_grads(fn, *a))(q, k, v, ct)
  want = jax.jit(lambda *a: _value_and_grads(_reference(seg, 0.25), *a))(q, k, v, ct)
  _assert_close(got, want, 2e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["dq_and_dkv_kernels", "fused_backward"])
def test_splash_query_chunks_match_reference(fused):
  """Query rows in 3 chunks, each against its causal key prefix (T = 300 pads to 3 x 128):
  documents cross the chunk borders at 128 and 256, one starts in the first chunk and ends in
  the last; same values and gradients as the reference."""
  q, k, v, seg, ct = _inputs(2, 300, 2, 48, 32, [([1, 2, 0], [90, 200, 10]),
                                                   ([5, 6], [120, 180])])
  blocks = sa.block_sizes(128, fused_backward=fused)
  fn = lambda q, k, v: jnp.where(
      (seg != 0)[:, :, None, None],
      sa.splash_attention(q, k, v, scale=0.25, segment_ids=seg, blocks=blocks, interpret=True,
                          query_chunks=3), 0)
  got = jax.jit(lambda *a: _value_and_grads(fn, *a))(q, k, v, ct)
  want = jax.jit(lambda *a: _value_and_grads(_reference(seg, 0.25), *a))(q, k, v, ct)
  _assert_close(got, want, 2e-5)
  with pytest.raises(ValueError, match="query_chunks"):
    sa.splash_attention(q, k, v, scale=0.25, segment_ids=seg, query_chunks=0)


@pytest.mark.parametrize("fused,query_chunks", [(False, 1), (True, 2)])
def test_splash_with_context_axis_under_remat_matches_reference(fused, query_chunks):
  """Context parallelism splits heads inside the kernel (kernel_heads -> tensor, context), and
  the save_attention remat policy keeps the kernel's outputs (each query chunk's): same values
  and gradients."""
  from c2.model.block import remat_policy  # pylint: disable=import-outside-toplevel
  q, k, v, seg, ct = _inputs(2, 200, 4, 48, 32, [([1, 2], [60, 140]), ([3, 0], [170, 30])])
  blocks = sa.block_sizes(128, fused_backward=fused)
  inner = lambda q, k, v: jnp.where(
      (seg != 0)[:, :, None, None],
      sa.splash_attention(q, k, v, scale=0.25, segment_ids=seg, interpret=True, blocks=blocks,
                          query_chunks=query_chunks), 0)
  fn = jax.checkpoint(inner, policy=remat_policy("save_attention"))
  with jax.set_mesh(meshlib.make_mesh({"fsdp": 2, "tensor": 2, "context": 2})):
    got = jax.jit(lambda *a: _value_and_grads(fn, *a))(q, k, v, ct)
  want = jax.jit(lambda *a: _value_and_grads(_reference(seg, 0.25), *a))(q, k, v, ct)
  _assert_close(got, want, 2e-5)


@pytest.mark.parametrize("seq_len,block_q,block_kv", [(1024, 128, 128), (768, 256, 128),
                                                      (1024, 128, 512)])
def test_causal_block_mask_gives_the_stock_mask_info(seq_len, block_q, block_kv):
  """The O(1)-per-block causal mask yields the same kernel metadata as jax's CausalMask."""
  blocks = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_q_dkv=block_q,
                             block_kv_dkv=block_kv, block_q_dq=block_q, block_kv_dq=block_kv)
  stock = splash.make_splash_mha(
      splash_mask.MultiHeadMask([splash_mask.CausalMask((seq_len, seq_len))] * 2),
      block_sizes=blocks, head_shards=1, q_seq_shards=1)
  fast = sa.make_kernel(2, seq_len, blocks)
  _assert_same_mask_info(stock, fast)


def test_causal_block_mask_of_a_query_chunk_gives_the_stock_mask_info():
  """The last 256 queries against all 1024 keys (a query chunk, make_kernel's kv_len)."""
  blocks = splash.BlockSizes(block_q=128, block_kv=256, block_q_dkv=128, block_kv_dkv=256,
                             block_q_dq=128, block_kv_dq=256)
  stock = splash.make_splash_mha(
      splash_mask.MultiHeadMask([splash_mask.CausalMask((256, 1024), offset=768)] * 2),
      block_sizes=blocks, head_shards=1, q_seq_shards=1)
  _assert_same_mask_info(stock, sa.make_kernel(2, 256, blocks, kv_len=1024))
  # 2 query blocks x 4 kv blocks, the last kv block half causal for the first query block
  assert sa.causal_block_fraction(256, 128, 256, kv_len=1024) == 1.0
  assert sa.causal_block_fraction(256, 128, 512, kv_len=1024) == 1.0
  assert sa.causal_block_fraction(512, 128, 128, kv_len=1024) == pytest.approx(
      (5 + 6 + 7 + 8) / (4 * 8))


def _assert_same_mask_info(stock, fast):
  for want, got in ((stock.fwd_mask_info, fast.fwd_mask_info),
                    (stock.dq_mask_info, fast.dq_mask_info),
                    (stock.dkv_mask_info, fast.dkv_mask_info)):
    for w, g in zip(want, got):
      assert (w is None) == (g is None)
      if w is not None and not isinstance(w, bool):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# --- TPU AOT: compile for a TPU topology from this host (libtpu, no TPU needed) ---

def _tpu_mesh(layout, topology="v5p:2x2x1"):
  from c2.perf.aot import topology_devices  # pylint: disable=import-outside-toplevel
  return meshlib.make_mesh(layout, devices=topology_devices(topology))


def _compile_model_grad(b, t, layout, fused_backward=False, query_chunks=1):
  """One dense block (no MTP) of the tiny preset, attention_impl="auto", grad of a loss."""
  from c2 import model  # pylint: disable=import-outside-toplevel
  from c2.model.config import get_preset  # pylint: disable=import-outside-toplevel
  cfg = get_preset("tiny", num_layers=1, first_k_dense=1, mtp_depth=0, attention_impl="auto",
                   splash_fused_backward=fused_backward, splash_query_chunks=query_chunks)
  mesh = _tpu_mesh(layout)
  params = with_shardings(model.abstract_params(cfg), model.param_shardings(cfg, mesh))
  batch = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))

  def loss(p, tokens, seg, pos):
    return jnp.sum(model.forward(cfg, p, tokens, seg, pos)["hidden"].astype(jnp.float32) ** 2)

  with jax.set_mesh(mesh):
    return cfg, jax.jit(jax.grad(loss)).lower(params, batch, batch, batch).compile()


@pytest.mark.tpu_aot
@needs_libtpu
@pytest.mark.parametrize("fused,chunks", [(False, 1), (True, 1), (True, 2)],
                         ids=["dq_and_dkv_kernels", "fused_backward", "fused_2_query_chunks"])
def test_model_train_grad_compiles_with_splash_on_tpu(fused, chunks):
  """Forward + backward at 1024 tokens: the TPU mesh makes "auto" pick splash although this
  host is a CPU; the fwd, dQ and dKV kernels (fwd and one backward kernel with
  ModelConfig.splash_fused_backward; per query chunk with splash_query_chunks) are in the HLO,
  and all temporaries (7.3 MiB unfused) stay below one device's dense [B, H, T, T] float32
  scores (16 MiB; the reference: 19.4 MiB), by half but with chunks."""
  b, t = 4, 1024
  cfg, compiled = _compile_model_grad(b, t, {"fsdp": 2, "tensor": 2}, fused, chunks)
  assert compiled.as_text().count("tpu_custom_call") == (2 if fused else 3) * chunks
  dense_scores = (b // 2) * (cfg.num_heads // 2) * t * t * 4
  # Chunks add each chunk's key prefix and its gradient (11.0 MiB in all at this T, where the
  # dq partials they divide are small; at 32k they save far more: the test below).
  assert compiled.memory_analysis().temp_size_in_bytes < dense_scores / (2 if chunks == 1 else 1)


@pytest.mark.slow
@pytest.mark.tpu_aot
@needs_libtpu
def test_model_train_grad_at_32k_tokens_fits_in_o_of_t():
  """Batch 1 x 32,768 tokens, heads over tensor=4: ~140 MiB of temporaries vs 4 GiB for one
  device's dense scores. Slow: 45 s to 2.5 min of XLA codegen on 2 cores, by load."""
  _, compiled = _compile_model_grad(1, 32768, {"tensor": 4})
  assert compiled.as_text().count("tpu_custom_call") == 3
  assert compiled.memory_analysis().temp_size_in_bytes < 512 << 20


@pytest.mark.tpu_aot
@needs_libtpu
@pytest.mark.parametrize("fused,chunks", [
    (False, 1), (True, 1),
    pytest.param(True, 8, marks=pytest.mark.slow),  # ~19 s of XLA compile for 16 kernels
], ids=["dq_and_dkv_kernels", "fused_backward", "fused_8_query_chunks"])
def test_splash_at_32k_tokens_needs_o_of_t_memory(fused, chunks):
  """Attention fwd + bwd at 32,768 tokens (batch 1, 4 heads over tensor=4, tiny MLA dims):
  with separate dq and dkv kernels temporaries are O(T) (~73 MiB: lane-broadcast segment ids
  and positions, lse, padded q/k/v), not the 4 GiB of one device's dense [1, 1, T, T] float32
  scores. The fused backward adds dq per kv block: T / 512 x [T, 128] bf16 = 512 MiB here; in
  8 query chunks at most T / 512 x [T / 8, 128] = 64 MiB per call."""
  t = 32768
  blocks = sa.block_sizes(t, fused_backward=fused)
  mesh = _tpu_mesh({"tensor": 4})
  spec = NamedSharding(mesh, P(None, None, "tensor", None))
  sds = lambda d: jax.ShapeDtypeStruct((1, t, 4, d), jnp.bfloat16, sharding=spec)
  seg = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=NamedSharding(mesh, P()))

  def loss(q, k, v, segment_ids):
    out = sa.splash_attention(q, k, v, scale=0.1, segment_ids=segment_ids, blocks=blocks,
                              query_chunks=chunks)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(sds(48), sds(48), sds(32),
                                                                 seg).compile()
  assert compiled.as_text().count("tpu_custom_call") == (2 if fused else 3) * chunks
  temporaries = compiled.memory_analysis().temp_size_in_bytes
  print(f"splash at 32k, fused backward {fused}, {chunks} query chunks: temporaries "
        f"{temporaries / 2**20:.1f} MiB")
  assert temporaries < ((256 + 512 // chunks) << 20 if fused else 256 << 20)  # dense: 4 GiB
  # The chunks compute the same score blocks as one call: each matmul over the causal blocks
  # at the head dims padded to 64 (48 and 32 -> 64), forward 2, backward 5 fused or 4 + 3
  # separate.
  from c2.perf import hlo_flops  # pylint: disable=import-outside-toplevel
  pairs = t * t * sa.causal_block_fraction(t, blocks.block_q, blocks.block_kv)  # one head
  counted = hlo_flops.count_flops(compiled.as_text())
  assert counted.total == 2 * pairs * 64 * (2 + (5 if fused else 7))
  # Recounted at 128-lane head dims (the MXU-time upper bound the AOT report prints): twice.
  assert sa.flops_at_lane_heads(counted.by_kind, 48, 32, fused) == pytest.approx(
      2 * pairs * 128 * (2 + (5 if fused else 7)), rel=1e-12)


def test_blockwise_under_a_layer_scan_keeps_its_memory_per_tile():
  """As the model runs it, under a scan over layers: the gradient's compiled program holds
  nothing larger than the layers' stacked [B, T, H, K] residuals. Without `tied_to`
  (blockwise_attention.py) JAX's scan partial evaluation hoisted every tile's mask out of the
  layer loop, stacked as [query blocks, key blocks, B, H, Q, C]: the [T, T] scores."""
  b, t, h, k = 1, 1024, 2, 16
  seg = jnp.ones((b, t), jnp.int32)

  def loss(q, k_, v):
    def layer(x, _):
      out = blockwise_attention(x, k_, v, scale=0.3, q_segment_ids=seg, kv_segment_ids=seg,
                                block_q=128, block_kv=128)
      return x + out, None
    return jnp.sum(jax.lax.scan(layer, q, None, length=2)[0] ** 2)

  shape = jax.ShapeDtypeStruct((b, t, h, k), jnp.float32)
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile().as_text()
  largest = largest_arrays(hlo)
  assert largest[0][0] <= 2 * b * t * h * k, f"largest arrays {largest[:3]}"  # 2 layers


def test_flops_at_lane_heads_recounts_only_the_splash_kernels():
  """Kimi's heads, K = 192 and J = 128, recounted at 256 and 128: the forward's q.k^T and p.v
  (1, 1 units) scale by 384 / 320, the fused backward's (3, 2) by 1024 / 832, the separate dkv
  kernel's (2, 2) by 768 / 640; XLA dots and other kernels stay."""
  by_kind = {"xla dot/convolution": 10.0, "kernel gmm_bf16": 5.0,
             "kernel splash_mha_fwd_segmented_residuals": 320.0,
             "kernel splash_mha_dkv_segmented_no_residuals": 832.0}
  assert sa.flops_at_lane_heads(by_kind, 192, 128, True) == pytest.approx(10 + 5 + 384 + 1024)
  assert sa.flops_at_lane_heads(by_kind, 192, 128, False) == pytest.approx(
      10 + 5 + 384 + 832 * 768 / 640)
  assert sa.flops_at_lane_heads(by_kind, 256, 128, True) == pytest.approx(sum(by_kind.values()))
