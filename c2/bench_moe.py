"""Routed-expert FFN paths side by side on this backend: which dropless path is fastest here.

  python -m c2.bench moe [--tokens 4096] [--preset tiny] [--repeats 5]

Times forward + backward of the routed experts of one MoE layer (same routes, same weights) for
each implementation the MoE layer can use, in one run, and prints times as ratios to the fastest
(CPU timings are noisy: read the ratios, not the absolute numbers):
  all_experts   every token through every expert, mixed by a dense weight matrix (3 batched
                matmuls, E/K times the FLOPs): what `gmm_impl="auto"` picks on CPU
  ragged_dot    sort by expert + jax.lax.ragged_dot: what "auto" picks on TPU/GPU
  dense_gmm     sort by expert + every row against every group (the "dense" grouped matmul)
  pallas_bf16   sort by expert + pallas_kernels.gmm (interpret mode off TPU)
It also checks every path against the first, so a fast wrong path cannot win.
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from c2.model_config import get_preset
from c2.nn import dispatch
from c2.ops.gmm import grouped_matmul


def _paths():
  gmm = lambda impl, **kw: functools.partial(grouped_matmul, impl=impl, **kw)
  return {
      "all_experts": lambda x, i, w, g, u, d: dispatch.all_experts_ffn(x, i, w, g, u, d),
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
  for name, path in _paths().items():
    if name in skip:
      continue

    def loss(x_, g_, u_, d_, path=path):
      return jnp.sum(path(x_, ids, weights, g_, u_, d_).astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    value, _ = step(x, gate, up, down)
    jax.block_until_ready(value)
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(step(x, gate, up, down))
      times.append(time.perf_counter() - start)
    reference = float(value) if reference is None else reference
    results[name] = (float(np.median(times)), abs(float(value) - reference) / abs(reference))

  fastest = min(t for t, _ in results.values())
  print(f"{'path':<14}{'median s':>10}{'x fastest':>11}{'rel diff':>11}")
  for name, (seconds, diff) in sorted(results.items(), key=lambda kv: kv[1][0]):
    print(f"{name:<14}{seconds:>10.4f}{seconds / fastest:>11.2f}{diff:>11.1e}")
  return 0
