"""Routed-expert FFN paths side by side on this backend: which dropless path is fastest here.

  python -m c2.bench moe [--tokens 4096] [--preset tiny] [--repeats 5]

Times forward + backward of the routed experts of one MoE layer (same routes, same weights) for
each implementation the MoE layer can use, in one run, and prints times as ratios to the fastest
(CPU timings are noisy: read the ratios, not the absolute numbers):
  all_experts   what `gmm_impl="auto"` picks on CPU (dispatch.all_experts_ffn): batched matmuls
                per expert over its tokens, padded to the largest group (from 16 tokens)
  every_expert  every token through every expert, mixed by a dense weight matrix (3 batched
                matmuls, E/K times the FLOPs)
  ragged_dot    sort by expert + jax.lax.ragged_dot: what "auto" picks on TPU/GPU
  dense_gmm     sort by expert + every row against every group (the "dense" grouped matmul)
  pallas_bf16   sort by expert + pallas_kernels.gmm (interpret mode off TPU)
It also checks every path against the first (relative difference of the loss and of every
gradient) and exits 1 when one differs by more than the compute dtype allows, so a fast wrong
path cannot win.
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from c2.model.config import get_preset

# Paths sum the same products in different orders (and bf16 paths round intermediate rows):
# the relative difference allowed is a few units of the compute dtype's roundoff, 2^-8 in
# bfloat16 (measured up to 6.8e-3 on the tiny preset, 256 tokens) and 1e-5 in float32.
REL_TOLERANCE = {"bfloat16": 2.0**-6, "float32": 1e-5}
from c2.model import dispatch
from c2.ops.gmm import grouped_matmul


def paths():
  gmm = lambda impl, **kw: functools.partial(grouped_matmul, impl=impl, **kw)
  return {
      "all_experts": lambda x, i, w, g, u, d: dispatch.all_experts_ffn(x, i, w, g, u, d),
      "every_expert": lambda x, i, w, g, u, d: dispatch.every_expert_ffn(x, i, w, g, u, d),
      "ragged_dot": lambda x, i, w, g, u, d: dispatch.local_ffn(x, i, w, g, u, d, gmm("ragged_dot")),
      "dense_gmm": lambda x, i, w, g, u, d: dispatch.local_ffn(x, i, w, g, u, d, gmm("dense")),
      "pallas_bf16": lambda x, i, w, g, u, d: dispatch.local_ffn(x, i, w, g, u, d,
                                                                 gmm("pallas", fmt="bf16")),
  }


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m c2.bench moe", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--skip", default="", help="comma-separated paths to skip")
  args = parser.parse_args(argv)

  cfg = get_preset(args.preset)
  n, d, f = args.tokens, cfg.hidden_size, cfg.moe_ffn_size
  e, k = cfg.num_routed_experts, cfg.experts_per_token
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(cfg.dtype)
  mk = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2]), dtype)
  x, gate, up, down = mk(n, d), mk(e, d, f), mk(e, d, f), mk(e, f, d)
  ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32)
  print(f"backend {jax.default_backend()}  preset {args.preset}: N={n} D={d} F={f} E={e} K={k} "
        f"dtype {dtype.name}")

  results, reference = {}, None
  skip = set(filter(None, args.skip.split(",")))
  for name, path in paths().items():
    if name in skip:
      continue

    def loss(x_, g_, u_, d_, path=path):
      return jnp.sum(path(x_, ids, weights, g_, u_, d_).astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    outputs = jax.block_until_ready(step(x, gate, up, down))
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(step(x, gate, up, down))
      times.append(time.perf_counter() - start)
    reference = outputs if reference is None else reference
    results[name] = (float(np.median(times)), max_rel_diff(outputs, reference))

  fastest = min(t for t, _ in results.values())
  tolerance = REL_TOLERANCE[dtype.name]
  print(f"{'path':<14}{'median s':>10}{'x fastest':>11}{'rel diff':>11}   (tolerance {tolerance:.1e})")
  failed = []
  for name, (seconds, diff) in sorted(results.items(), key=lambda kv: kv[1][0]):
    mark = "  FAIL" if diff > tolerance else ""
    failed += [name] if mark else []
    print(f"{name:<14}{seconds:>10.4f}{seconds / fastest:>11.2f}{diff:>11.1e}{mark}")
  if failed:
    print(f"FAILED: {', '.join(failed)} disagree with {next(iter(results))} beyond {tolerance:.1e}")
  return 1 if failed else 0


def max_rel_diff(outputs, reference) -> float:
  """Largest relative difference over the loss and every gradient (each by its max |ref|)."""
  def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
  return max(rel(a, b) for a, b in zip(jax.tree.leaves(outputs), jax.tree.leaves(reference)))
