"""The proxy and full-scale shapes and parallel layouts every phase's experiment file shares.

Each function sets the model preset, sequence length and batch, mesh and AOT target of a scale
on an experiment ConfigDict; the phase files set only their own data, optimizer and schedule on
top. The figures are those `python -m c2.aot` measured for experiments/pretrain.py (README).
"""
import ml_collections

KIMI_TOKENIZER = "tiktoken:/path/to/kimi/tiktoken.model"


def proxy(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """~30B-A3B at 32k tokens on 64 v5p chips, one 32k row per chip (fsdp8 x expert8): remat of
  all but the attention kernel's outputs, and splash's fused backward: 74.4 GiB of 95 per
  device, FLOP ratio 1.33 (separate dq / dkv kernels: 58.0 GiB, 1.52; full remat: 56.3 GiB, 1.51,
  or 46.9 GiB, 1.70 unfused; 256 rows: 144 GiB, does not fit)."""
  c.model.preset = "proxy-30b"
  c.model.update(ep_capacity_factor=2.0, remat_policy="save_attention", splash_fused_backward=True)
  c.data.update(tokenizer=KIMI_TOKENIZER, seq_len=32768, global_batch_size=64)
  c.mesh.update(fsdp=-1, expert=8)
  # 2,048 tokens per device per loss chunk (ce_chunk_size counts the 64 chips' tokens): measured
  # 524 GiB of collectives per device per step instead of 1,424 at 8,192; HBM, FLOPs unchanged.
  c.train.update(max_minutes=None, eval_batches=16, ce_chunk_size=2048 * 64)
  c.aot.update(topology="v5p:4x4x4")
  return c


def full(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The 1.04T Kimi-K2.5 at 32k tokens, 1,024 sequences, on 4096 v5p chips: one sequence per
  (fsdp, expert) pair split over 4 context shards (context shards split the heads inside the
  attention kernel, c2/parallel/sharding.py). Bounded expert-parallel buffers (2x the mean load;
  drops are logged): the dropless worst case would cost EP=16 times the dispatched activations.
  Remat recomputes all but the attention kernel's outputs (at 32k attention is most of a layer's
  FLOPs): 55.9 of 95 GiB per device, FLOP ratio 1.61 (full remat: 39.9 GiB, 1.77). Measured on
  the Ulysses splash path (2026-12-04): save_wide_dots (c2/model/block.py) 75.3 GiB, 1.571: -0.04
  for +19.5 GiB, not taken. The rest of the excess is the splash kernels (x1.90 of useful
  attention: unfused backward, 192 -> 256 head padding) and the recomputed routed experts.
  The loss projects 2,048 tokens per device per chunk (ce_chunk_size counts the whole pod's
  tokens): 4 chunk steps instead of 4,096, each of which gathered the 2.2 GiB output head and
  reduced its gradient. Measured: collective bytes per device per step 1,236 GiB instead of
  28,090 GiB, HBM (55.9 GiB) and FLOP ratio unchanged. Splash's fused backward (one kernel for
  dq and dkv, c2.ops.splash_attention.block_sizes): 60.7 GiB, FLOP ratio 1.456 (2026-12-04);
  the grouped matmuls computing group-boundary tiles by 128-row slabs (pallas_kernels/
  gmm_kernel.py): 60.7 GiB, 1.385; the fused backward in 4 query chunks: 56.2 GiB, 1.385 (on
  tpu7x:8x16x16 71.1 of 96 GiB, 1.409; 2 x v5p:16x16x8 78.4 GiB, 1.385; 2026-12-06); splash
  given the 192-wide heads unpadded (c2/ops/splash_attention.py, 2026-12-06): 56.3 GiB, FLOP
  ratio 1.281 (1.385 with its matmuls recounted at 256-wide heads)."""
  c.model.preset = "kimi-k2.5"
  # Fused splash backward in 4 query chunks: its dq partials then cost about what the separate
  # kernels' second score pass saved in memory, on every topology measured (README).
  c.model.update(ep_capacity_factor=2.0, remat_policy="save_attention", splash_fused_backward=True,
                 splash_query_chunks=4)
  c.data.update(tokenizer=KIMI_TOKENIZER, seq_len=32768, global_batch_size=1024)
  c.mesh.update(fsdp=-1, expert=16, tensor=1, context=4)
  c.train.update(max_minutes=None, eval_batches=16, ce_chunk_size=2048 * 4096)
  c.aot.update(topology="v5p:16x16x16")
  return c


def proxy_256k(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The proxy at 262144 tokens (phase 2), 8 rows per step on the 64 chips of `proxy`: each row
  split over 8 context shards, so a device holds 32k tokens as in phase 1. Measured (AOT,
  Ulysses path; a slow test in tests/perf/test_aot.py): with splash's separate backward
  kernels (2026-12-04) 60.1 of 95 GiB per device, FLOP ratio 1.788 (splash 91% of the FLOPs),
  613 GiB of collectives per device per step, compile 428 s at 17.3 GB of host memory; fused in
  16 query chunks, with boundary slabs in the grouped matmuls (2026-12-06) 64.6 GiB (68%),
  FLOP ratio 1.435 (splash 90%), 615 GiB; with splash's heads unpadded (192, 2026-12-06)
  64.2 GiB (68%), FLOP ratio 1.202 (1.436 recounted at 256-wide heads), 615 GiB, compile 649 s
  at 19.6 GB of host memory."""
  proxy(c)
  # The fused backward's dq per kv block grows as T^2 (block_sizes): in 16 query chunks each
  # call holds 1/16 of it.
  c.model.update(splash_fused_backward=True, splash_query_chunks=16)
  c.data.update(seq_len=262144, global_batch_size=8)
  c.mesh.update(fsdp=-1, expert=8, context=8)
  return c


def full_256k(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The full model at 262144 tokens (phase 2): phase 1's tokens per step (128 x 256k = 1024 x
  32k) on the same 4096 chips, each row over 32 context shards (fsdp 8 x expert 16 x context
  32), so a device holds 8k tokens as in `full`. Measured (AOT, Ulysses path): with splash's
  separate backward kernels (2026-12-04) 59.3 of 95 GiB per device, FLOP ratio 1.801 (splash
  87% of the FLOPs), 1,242 GiB of collectives per device per step, compile 472 s at 17.1 GB of
  host memory; fused in 16 query chunks and with boundary slabs in the grouped matmuls
  (2026-12-06) 71.7 GiB (75%), FLOP ratio 1.447 (splash 85%), 1,245 GiB, compile 556 s; with
  splash's heads unpadded (192, 2026-12-06) 71.7 GiB, FLOP ratio 1.224 (1.447 recounted at
  256-wide heads), 1,245 GiB, compile 641 s at 19.4 GB of host memory. The latent all-gather
  path (--config.model.context_parallel=latent_all_gather) with its masks tied per layer
  (2026-12-06): 58.2 GiB (61%), FLOP ratio 1.345 (its XLA dots also at K = 192), 1,156 GiB,
  compile 199 s: less HBM and 7% fewer collective bytes, but 10% more FLOPs and its tiles
  through HBM; not the default (README). Tune here."""
  full(c)
  # The fused backward's dq per kv block grows as T^2 (block_sizes): in 16 query chunks each
  # call holds 1/16 of it (about 4 GiB per device instead of 64).
  c.model.update(splash_fused_backward=True, splash_query_chunks=16)
  c.data.update(seq_len=262144, global_batch_size=128)
  c.mesh.update(fsdp=-1, expert=16, tensor=1, context=32)
  return c
