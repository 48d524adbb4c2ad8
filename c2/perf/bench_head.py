"""The loss head over every token vs over the weighted tokens only (`train.ce_weighted_only`).

  python -m c2.bench head [--rows 6] [--seq-len 1536] [--weighted 0.15] [--repeats 5]

Times one gradient of the whole objective (model forward + backward, loss head included) of the
LM loss (SFT: main CE and the MTP distillation) and of the RL loss (policy gradient, router
replay off) on the same batch, with the head projecting every token and with it projecting only
the weighted ones (c2/losses/head.py, `weighted_only`), in one run, and prints the ratio (CPU
timings are noisy: read the ratios). Rows hold one weighted span of `--span` tokens per segment
of context: tool-use SFT on the tiny pipeline's transcripts weighs ~15% of a row's tokens (the
model's own turns; the files it reads are context). The two settings must agree: the loss and
every gradient within float32 roundoff (relative 1e-5), else the exit status is 1.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from c2 import model
from c2.losses import lm as lm_lib
from c2.losses import rl as rl_lib
from c2.model.config import get_preset
from c2.perf import bench_moe

REL_TOLERANCE = 1e-5  # float32: the two settings sum the same products in other orders


def synthetic_batch(rows: int, seq_len: int, weighted: float, span: int, vocab: int,
                    seed: int = 0) -> dict:
  """Packed rows of random tokens whose loss mask covers `weighted` of each row in spans of
  `span` tokens, each span closing a segment (a turn after its context), plus the RL fields."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, vocab, (rows, seq_len)).astype(np.int32)
  segments = np.zeros((rows, seq_len), np.int32)
  positions = np.zeros((rows, seq_len), np.int32)
  mask = np.zeros((rows, seq_len), np.float32)
  period = max(span + 1, int(round(span / max(weighted, 1e-6))))
  for row in range(rows):
    offset = int(rng.integers(0, period))
    for segment, start in enumerate(range(-offset, seq_len, period), start=1):
      lo, hi = max(start, 0), min(start + period, seq_len)
      segments[row, lo:hi] = segment
      positions[row, lo:hi] = np.arange(lo - start, hi - start)
      mask[row, max(hi - span, lo):hi] = 1.0
  batch = {"tokens": tokens, "segment_ids": segments, "positions": positions, "loss_mask": mask,
           "advantages": rng.normal(size=(rows, seq_len)).astype(np.float32) * mask,
           "sampler_logp": -rng.exponential(2.0, (rows, seq_len)).astype(np.float32) * mask}
  return {k: jnp.asarray(v) for k, v in batch.items()}


def objectives(cfg, chunk: int, mtp_weight: float, normalizer: float) -> dict:
  """name -> (weighted_only -> loss function of (params, batch))."""
  def lm(weighted_only):
    weights = lm_lib.LossWeights(ce_chunk_size=chunk, mtp_weight=mtp_weight,
                                 ce_weighted_only=weighted_only)
    return lambda p, b: lm_lib.lm_loss(cfg, p, b, weights)[0]

  def rl(weighted_only):
    weights = rl_lib.RLLossWeights(normalizer=normalizer, chunk_size=chunk,
                                   weighted_only=weighted_only)
    return lambda p, b: rl_lib.rl_loss(cfg, p, b, weights)[0]

  return {"sft (lm loss)": lm, "rl (policy gradient)": rl}


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m c2.bench head", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--layers", type=int, default=0, help="model layers (0: the preset's)")
  parser.add_argument("--rows", type=int, default=6)
  parser.add_argument("--seq-len", type=int, default=1536)
  parser.add_argument("--weighted", type=float, default=0.15,
                      help="fraction of each row the loss weighs")
  parser.add_argument("--span", type=int, default=48, help="tokens per weighted span")
  parser.add_argument("--chunk", type=int, default=1024, help="head chunk (train.ce_chunk_size)")
  parser.add_argument("--mtp-weight", type=float, default=0.3)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  if not 0 < args.weighted <= 1:
    parser.error(f"--weighted must be in (0, 1], got {args.weighted}")

  cfg = get_preset(args.preset, dtype="float32")
  if args.layers:
    cfg = cfg.replace(num_layers=args.layers)
  params = model.init_params(cfg, jax.random.key(0))
  batch = synthetic_batch(args.rows, args.seq_len, args.weighted, args.span, cfg.vocab_size)
  share = float(jnp.mean(batch["loss_mask"]))
  print(f"backend {jax.default_backend()}  preset {args.preset} (float32): {args.rows} rows x "
        f"{args.seq_len}, {share:.1%} of tokens weighted, head chunks of {args.chunk}")
  print(f"{'objective':<22}{'all tokens s':>14}{'weighted s':>12}{'speedup':>9}{'rel diff':>10}")
  failed = []
  normalizer = float(args.rows * args.seq_len)
  for name, make in objectives(cfg, args.chunk, args.mtp_weight, normalizer).items():
    steps = [jax.jit(jax.value_and_grad(make(flag))) for flag in (False, True)]
    outputs = [jax.block_until_ready(step(params, batch)) for step in steps]
    best = [float("inf")] * 2
    for _ in range(args.repeats):  # interleaved: a slow stretch lands on both sides
      for i, step in enumerate(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(params, batch))
        best[i] = min(best[i], time.perf_counter() - start)
    diff = bench_moe.max_rel_diff(outputs[1], outputs[0])
    mark = "  FAIL" if diff > REL_TOLERANCE else ""
    failed += [name] if mark else []
    print(f"{name:<22}{best[0]:>14.3f}{best[1]:>12.3f}{best[0] / best[1]:>8.2f}x{diff:>10.1e}"
          f"{mark}")
  if failed:
    print(f"FAILED: {', '.join(failed)}: the settings disagree beyond {REL_TOLERANCE:.0e}")
  return 1 if failed else 0
