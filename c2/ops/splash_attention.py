"""The TPU path: jax's Pallas splash attention kernel behind the c2 attention contract.

Glossary: B batch, T length, H heads, K query/key head dim, J value head dim.

The kernel (jax.experimental.pallas.ops.tpu.splash_attention) works on one sequence,
q [H, T, K], k [H, T, K], v [H, T, J], with a static mask (here causal) AND-ed with segment ids,
and has its own custom VJP (separate dQ and dKV kernels, or one fused backward kernel: see
block_sizes). This wrapper adapts it:

  - the softmax scale (MLA folds YaRN's mscale^2 into it) is multiplied into q: the kernel has
    no scale argument;
  - q/k and v head dims are zero-padded only to a multiple of 64 (K 192 and J 128 stay; tiny
    preset 48 -> 64, 32 -> 64): Mosaic takes a block whose minor dim is the array's whole dim,
    and 192 compiles for v5p and tpu7x (AOT). Padding 192 -> 256, as before 2026-12-06, made
    the kernel-layout copies of q and k (and dq, dk) a third wider and computed 4 of the 7
    score-sized matmuls over 256 columns. What unpadding buys on a chip is between two bounds:
    q.k^T (forward and the backward's recompute) contracts over K, which a 128-wide MXU takes
    in two passes for 192 as for 256, so those two save no MXU time; dq = ds.k and dk = ds^T.q
    have K as an output dimension, which costs no padding when it is the streamed side. The
    FLOP ratio counts the dims the kernel gets (192); c2.aot prints beside it the count at
    128-lane dims (`flops_at_lane_heads`), the upper bound;
  - T is padded to a multiple of the blocks with segment id 0 and sliced back;
  - it runs per device inside `jax.shard_map` with batch and heads manual (logical axes
    `batch` and `kernel_heads`, so the rules table decides the mesh axes) and vmaps the kernel
    over the local batch. The length stays whole on each device; with context parallelism the
    context axis splits the heads inside the kernel instead (XLA inserts the all-to-alls that
    swap sequence shards for head shards): without that, every context shard would compute the
    whole attention (measured by c2.aot: 4x the attention FLOPs at context=4).
Padding query rows (segment 0) attend causally to other padding tokens; the dispatcher zeroes
their outputs.

Query chunks (`query_chunks`, ModelConfig.splash_query_chunks): the row's queries split into C
chunks, each a kernel call against its causal key prefix (a causal mask offset by the chunk's
start). The calls compute the same score blocks as one call over the row, and autodiff sums
their dk, dv. What changes is the fused backward's dq per kv block, [prefix / block_kv, T / C,
H, K] per call instead of [T / block_kv, T, H, K]: the fused backward then fits at 256k.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from c2.ops.blockwise_attention import round_up
from c2.parallel.sharding import logical_to_spec
from c2.perf import hardware, hlo_flops

LANES = 128
KERNEL_OUTPUTS = "attention_kernel_outputs"  # checkpoint name of what the forward kernel made
HEAD_DIM_MULTIPLE = 64  # q/k and v head dims are zero-padded to a multiple of this

# Block sizes per TPU generation: rows (max_len, block_q, block_kv, block_kv_compute); the first
# row with T <= max_len wins (None: any length). The backward kernels
# use the same sizes. Untuned: 512 is MaxText's default for every splash block; 1024 beyond 64k
# keeps the host-side mask processing and the grid small. Blocks are clipped to T rounded up to
# 128, so short sequences do not pad to 512. Add a generation's rows here once measured.
SPLASH_BLOCKS: dict[str, tuple[tuple[Optional[int], int, int, int], ...]] = {
    "default": ((65536, 512, 512, 512), (None, 1024, 1024, 512)),
}


def block_sizes(seq_len: int, generation: Optional[str] = None,
                fused_backward: bool = False) -> splash.BlockSizes:
  """The table's block sizes for a sequence length on a generation ('v5p', 'tpu7x', ...).

  fused_backward: one backward kernel (dq accumulated inside the dkv kernel) instead of separate
  dq and dkv kernels that both recompute the scores and dp. It keeps dq per kv block
  ([T / block_kv, *q.shape]) until their sum, which grows as T^2 / block_kv. Measured (AOT,
  v5p:16x16x16, full 32k step): FLOP ratio 1.612 -> 1.456 for 55.9 -> 60.7 GiB per device; the
  same model over 2 slices (fsdp 32) went from 78.3 to 103.5 GiB, over the 95, and on
  tpu7x:8x16x16 from 70.9 to 95.05 of 96 GiB; at 256k it would hold about 64 GiB per device.
  Hence a per-layout choice (ModelConfig.splash_fused_backward), and query chunks
  (splash_attention's `query_chunks`, ModelConfig.splash_query_chunks) that divide the partials:
  the full 256k step fused in 16 chunks, 71.7 GiB and FLOP ratio 1.447 against 59.3 GiB and
  1.801 with separate kernels (AOT, v5p:16x16x16, 2026-12-06, heads padded to 256).
  """
  rows = SPLASH_BLOCKS.get(generation or "default", SPLASH_BLOCKS["default"])
  _, block_q, block_kv, compute = next(r for r in rows if r[0] is None or seq_len <= r[0])
  cap = round_up(seq_len, LANES)
  block_q, block_kv = min(block_q, cap), min(block_kv, cap)
  compute = compute if block_kv % compute == 0 else block_kv
  return splash.BlockSizes(
      block_q=block_q, block_kv=block_kv, block_kv_compute=compute,
      block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=compute,
      block_q_dq=None if fused_backward else block_q,
      block_kv_dq=None if fused_backward else block_kv, use_fused_bwd_kernel=fused_backward)


def generation_of(device) -> Optional[str]:
  """'v5p', 'v6e', 'tpu7x', ... for a (possibly abstract) device; None when unknown."""
  chip = hardware.chip_of_device(device)
  return next((name for name, spec in hardware.CHIPS.items() if spec is chip), None)


class CausalBlockMask(splash_mask.CausalMask):
  """`CausalMask` whose host-side block queries cost O(1) instead of O(block_q * block_kv).

  Building the kernel classifies every (q block, kv block) as empty, partial or full from
  `chunk.any()` / `chunk.all()`; the stock mask materialises each chunk, T^2 booleans in all
  (5.7 s of host time at 32k tokens, ~6 minutes at 256k by T^2 scaling; this: 0.24 s and
  2.1 s). Causality is monotone in both
  indices, so a block's any/all are its bottom-left / top-right corners: this returns the 2 x 2
  corners. The kernel itself never reads these chunks - it recomputes the mask from
  `q_sequence` with `mask_function` - and the resulting MaskInfo equals the stock one
  (tests/ops/test_attention.py checks it).
  """

  def __getitem__(self, idx) -> np.ndarray:
    q_slice, kv_slice = idx
    q_start, q_stop, _ = q_slice.indices(self.shape[0])
    kv_start, kv_stop, _ = kv_slice.indices(self.shape[1])
    rows = self.q_sequence[[q_start, q_stop - 1]]
    cols = np.array([kv_start, kv_stop - 1])
    return self.mask_function(rows[:, None], cols[None, :])


def make_kernel(num_heads: int, seq_len: int, blocks: splash.BlockSizes, interpret: bool = False,
                kv_len: Optional[int] = None):
  """A causal splash kernel for q [H, T, *] against k, v [H, kv_len, *] (default T): the queries
  are the last T of the kv_len positions (a chunk of rows against its key prefix). Mask
  processing is cached by jax per mask."""
  kv_len = seq_len if kv_len is None else kv_len
  causal = CausalBlockMask((seq_len, kv_len), offset=kv_len - seq_len)
  mask = splash_mask.MultiHeadMask([causal] * num_heads)
  return splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                interpret=interpret)


def _run_kernel(kernel, q, k, v, segment_ids):
  with jax.default_matmul_precision("default"):
    return jax.vmap(kernel)(q, k, v, segment_ids)


@jax.custom_vjp
def _splash_call(kernel, q, k, v, segment_ids):
  """The splash kernel, vmapped over the batch, with its kernels traced at DEFAULT matmul
  precision, forward and backward.

  Mosaic rejects HIGHEST (fp32 contract precision) on bf16 operands, so a global
  jax_default_matmul_precision="highest" (the CPU test suite sets one) would fail the TPU compile.
  The kernel's bf16 dots accumulate in float32 either way (float32 inputs on a TPU would get
  DEFAULT-precision dots; the model computes in bf16). The backward kernels are traced when the
  VJP runs, outside any caller's context, hence the custom_vjp around jax.vjp. The kernel (a
  pytree holding the mask's block tables) is an argument, not a closure: a custom_vjp closing
  over arrays of an enclosing trace breaks under jax.checkpoint.
  """
  return _run_kernel(kernel, q, k, v, segment_ids)


def _splash_call_fwd(kernel, q, k, v, segment_ids):
  out, vjp = jax.vjp(lambda q, k, v: _run_kernel(kernel, q, k, v, segment_ids), q, k, v)
  # The values the forward kernel made (output, logsumexp) are named, so a remat policy can keep
  # them (c2/model/block.py) and the backward need not rerun the forward kernel. Its inputs (q, k,
  # v: large, and cheap to recompute from the projections; the mask tables) are left to the
  # policy's default.
  inputs = {id(x) for x in jax.tree.leaves((kernel, q, k, v, segment_ids))}
  name = lambda x: x if id(x) in inputs else checkpoint_name(x, KERNEL_OUTPUTS)
  return name(out), jax.tree.map(name, vjp)


def _splash_call_bwd(vjp, d_out):
  with jax.default_matmul_precision("default"):
    return (None, *vjp(d_out), None)


_splash_call.defvjp(_splash_call_fwd, _splash_call_bwd)


def _local_splash(q, k, v, segment_ids, *, scale, blocks, generation, interpret, fused_backward,
                  query_chunks):
  """One device's shard: q [B, T, H, K], k [B, T, H, K], v [B, T, H, J] -> [B, T, H, J]."""
  t, h, v_dim = q.shape[1], q.shape[2], v.shape[3]
  blocks = blocks or block_sizes(t, generation, fused_backward)
  padded_t = round_up(t, query_chunks * math.lcm(blocks.block_q, blocks.block_kv))
  chunk = padded_t // query_chunks

  def to_kernel_layout(x):  # [B, T, H, D] -> [B, H, T', D'], zero padded
    d = x.shape[-1]
    x = jnp.pad(x, ((0, 0), (0, padded_t - t), (0, 0), (0, round_up(d, HEAD_DIM_MULTIPLE) - d)))
    return jnp.einsum("BTHD->BHTD", x)

  q = to_kernel_layout((q.astype(jnp.float32) * scale).astype(q.dtype))
  k, v = to_kernel_layout(k), to_kernel_layout(v)
  seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, padded_t - t)))
  # Query chunk c (rows [c * chunk, (c + 1) * chunk)) against its causal key prefix: the same
  # score blocks as one call, but the fused backward's dq per kv block is [prefix / block_kv,
  # chunk, H, K] per call instead of [T / block_kv, T, H, K] (module docstring).
  outs = []
  for end in range(chunk, padded_t + 1, chunk):
    kernel = make_kernel(h, chunk, blocks, interpret, kv_len=end)
    outs.append(_splash_call(
        kernel, q[:, :, end - chunk:end], k[:, :, :end], v[:, :, :end],
        splash.SegmentIds(q=seg[:, end - chunk:end], kv=seg[:, :end])))  # [B, H, chunk, J']
  out = jnp.concatenate(outs, axis=2)  # [B, H, T', J']
  return jnp.einsum("BHTJ->BTHJ", out)[:, :t, :, :v_dim].astype(v.dtype)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                     segment_ids: jax.Array, blocks: Optional[splash.BlockSizes] = None,
                     interpret: bool = False, fused_backward: bool = False,
                     query_chunks: int = 1) -> jax.Array:
  """Causal self-attention inside packed segments with the splash kernel.

  q [B, T, H, K], k [B, T, H, K], v [B, T, H, J], segment_ids [B, T] -> [B, T, H, J] (dtype of
  v). `blocks` overrides the table (and `fused_backward`, see block_sizes); `query_chunks` > 1
  runs one kernel per chunk of query rows against its key prefix (T is padded to a multiple of
  chunks x blocks), which divides the fused backward's dq partials by the chunk count;
  `interpret` runs the kernel in the Pallas interpreter (CPU tests). Under a mesh
  (jax.set_mesh) it runs in shard_map over the batch and head axes.
  """
  if query_chunks < 1:
    raise ValueError(f"query_chunks must be >= 1, got {query_chunks}")
  mesh = jax.sharding.get_abstract_mesh()
  has_mesh = mesh is not None and not mesh.empty
  device = mesh.abstract_device if has_mesh else None
  local = functools.partial(
      _local_splash, scale=float(scale), blocks=blocks, interpret=interpret,
      fused_backward=fused_backward, query_chunks=query_chunks,
      generation=generation_of(device if device is not None else jax.devices()[0]))
  if not has_mesh or math.prod(mesh.axis_sizes) == 1:
    with jax.named_scope("splash_attention"):
      return local(q, k, v, segment_ids)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  # Whole sequences per device; heads split over tensor and context (see c2/parallel/sharding.py).
  spec = logical_to_spec(("batch", None, "kernel_heads", None), q.shape, sizes)
  with jax.named_scope("splash_attention"):
    return jax.shard_map(local, in_specs=(spec, spec, spec, P(spec[0], None)), out_specs=spec,
                         check_vma=False)(q, k, v, segment_ids)


def causal_block_fraction(seq_len: int, block_q: int, block_kv: int,
                          kv_len: Optional[int] = None) -> float:
  """Fraction of the [T, kv_len] score matrix (kv_len default T; queries are the last T of the
  kv_len positions, as in make_kernel) the kernel computes under a causal mask: every
  (q-block, kv-block) pair holding at least one unmasked entry is computed whole."""
  kv_len = seq_len if kv_len is None else kv_len
  offset = kv_len - seq_len
  q_blocks, kv_blocks = -(-seq_len // block_q), -(-kv_len // block_kv)
  computed = sum(min(kv_blocks, (offset + (i + 1) * block_q - 1) // block_kv + 1)
                 for i in range(q_blocks))
  return computed * block_q * block_kv / (q_blocks * block_q * kv_blocks * block_kv)


# Matmuls per kernel over the score matrix, in units of (q.k contraction K, p.v contraction J):
# forward s = q k^T, o = p v; dq recomputes s, dp = do v^T, dq = ds k; dkv recomputes s,
# dv = p^T do, dp = do v^T, dk = ds^T q; the fused dkv kernel also makes dq = ds k.
_SPLASH_MATMULS = {"splash_mha_fwd": (1, 1, ""), "splash_mha_dq": (2, 1, "_dq"),
                   "splash_mha_dkv": (2, 2, "_dkv")}


def splash_kernel_flops(kernel: str, operand_shapes: list, attrs: str,
                        result_shapes: Sequence = ()) -> float:
  """FLOPs of one splash kernel call in compiled HLO (jax's splash declares no cost estimate).

  q, k, v are the first three float operands, [..., T, D] with the batch/head dims leading; the
  causal block fraction uses the kernel's block sizes from its xprof metadata when present. A
  dkv kernel with three large float results (dq per kv block, dk, dv) is the fused backward.
  """
  qk_units, pv_units, suffix = next(v for k, v in _SPLASH_MATMULS.items() if kernel.startswith(k))
  large = [dims for dtype, dims in result_shapes
           if dtype.startswith(("bf16", "f32", "f16")) and len(dims) >= 3]
  if kernel.startswith("splash_mha_dkv") and len(large) >= 3:
    qk_units += 1
  q, k, v = [dims for dtype, dims in operand_shapes if dtype.startswith(("bf16", "f32", "f16"))
             and len(dims) >= 3][:3]
  seq_q, seq_kv = q[-2], k[-2]

  def block(name: str, default: int) -> int:
    found = re.search(rf'\\"{name}{suffix}\\": (\d+)', attrs)
    return int(found.group(1)) if found else default

  default = block_sizes(seq_q)
  fraction = causal_block_fraction(seq_q, block("block_q", default.block_q),
                                   block("block_kv", default.block_kv), kv_len=seq_kv)
  pairs = math.prod(q[:-1]) * seq_kv * fraction  # (query, key) score entries computed
  return 2.0 * pairs * (qk_units * q[-1] + pv_units * v[-1])


def flops_at_lane_heads(flops_by_kind: dict, qk_dim: int, v_dim: int,
                        fused_backward: bool) -> float:
  """Compiled FLOPs with every splash kernel recounted at head dims rounded up to 128 lanes.

  flops_by_kind as hlo_flops.count_flops returns it (splash counted at the K and J it was given:
  the model's, padded to HEAD_DIM_MULTIPLE). Splash's matmuls are linear in K and J per kernel
  (the units table above), so each kernel's count scales by (qk K' + pv J') / (qk K + pv J).
  With K = 192 this is the upper bound on what unpadded heads cost in MXU time (module
  docstring); the full 32k step recounted this way gives 1.385, what it measured compiled with
  the heads padded to 256.
  """
  given = lambda d: round_up(d, HEAD_DIM_MULTIPLE)
  qk_dim, v_dim, lanes = given(qk_dim), given(v_dim), lambda d: round_up(d, LANES)
  total = 0.0
  for kind, value in flops_by_kind.items():
    name = kind.removeprefix("kernel ")
    units = next((u for k, u in _SPLASH_MATMULS.items() if name.startswith(k)), None)
    if units is None:
      total += value
      continue
    qk_units, pv_units = units[0] + (fused_backward and name.startswith("splash_mha_dkv")), units[1]
    total += value * ((qk_units * lanes(qk_dim) + pv_units * lanes(v_dim))
                      / (qk_units * qk_dim + pv_units * v_dim))
  return total


hlo_flops.register_kernel_rule(
    "splash_mha_", lambda kernel, operands, results, attrs: splash_kernel_flops(
        kernel, operands, attrs, results))
