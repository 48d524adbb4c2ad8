"""Grouped-matmul benchmark for `pallas_kernels` (gmm / tgmm in bf16, fp8, mxfp8, nvfp4).

  python -m c2.bench gmm                        # CPU: error table + AOT cost per TPU target
  python -m c2.bench gmm --targets v5p,tpu7x --aot-shapes kimi_up,kimi_down --formats nvfp4
  python -m c2.bench gmm --skip-errors          # AOT table only

On a CPU host it prints (1) errors per format against the float32 reference (the kernels run in
interpret mode; the run exits 1 when one exceeds its tolerance, SPEC_MAX_REL / F32_MEAN_REL) and (2) per TPU target, the AOT-compiled forward's FLOPs, bytes accessed and
temporary HBM (compiled.cost_analysis / memory_analysis, quantisation included), the tiles, the
VMEM estimate against the limit, and which MXU path the generation takes. On a TPU backend it
times pk.gmm per format beside jax.lax.ragged_dot (bf16) on the same shapes, in the same run.

Shapes (per device). Kimi-K2.5: D=7168, expert FFN F=2048, 384 experts, top-8. Expert
parallelism 8 puts 48 experts on each device; 4,096 tokens per device x top-8 = 32,768 routed
rows arrive per device on average, ~683 per expert (we draw ragged sizes, one expert empty, 3%
of rows unused as capacity padding):
  kimi_up     M=32768 K=7168 N=4096 G=48   gate and up projections fused (2 x F)
  kimi_down   M=32768 K=2048 N=7168 G=48   down projection
  small       M=512   K=256  N=384  G=8
Interpreting a full Kimi shape on two CPU cores would take hours, so the error table uses slices
with the real contraction lengths (they set the error): 1,024 rows over 4 experts, N=512.
Error metrics, over rows that belong to a group: max_rel = max|out - ref| / max|ref| and
mean_rel = mean|out - ref| / mean|ref|; "vs spec" compares with pallas_kernels.reference (the
same quantisation, float64 matmul), "vs f32" with the unquantised inputs.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
  m: int
  k: int
  n: int
  g: int


SHAPES = {
    "small": Shape(512, 256, 384, 8),
    "kimi_up": Shape(32768, 7168, 4096, 48),
    "kimi_down": Shape(32768, 2048, 7168, 48),
    "kimi_up_slice": Shape(1024, 7168, 512, 4),
    "kimi_down_slice": Shape(1024, 2048, 512, 4),
}
FORMATS = ("bf16", "fp8", "mxfp8", "nvfp4")
# Tolerances that make the run fail. Against the specification (the same quantised operands
# multiplied in float64) only the kernel's float32 accumulation differs: 1e-4 of the largest
# output is ~100x what K = 7168 terms cost. Against the unquantised float32 product, each operand
# element rounds to nearest with relative error at most the format's unit roundoff u = 2^-(m+1)
# (m mantissa bits); the mean relative error of a long dot product of random-signed terms stays
# below u (measured on `small`: bf16 2.3e-3, fp8 3.7e-2, mxfp8 3.7e-2, nvfp4 0.13).
SPEC_MAX_REL = 1e-4
F32_MEAN_REL = {"bf16": 2.0**-8, "fp8": 2.0**-4, "mxfp8": 2.0**-4, "nvfp4": 2.0**-2}
TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}


def ragged_sizes(shape: Shape, seed: int = 0) -> np.ndarray:
  """Dirichlet(2)-imbalanced group sizes over 97% of the rows, group 1 empty."""
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.full(shape.g, 2.0))
  if shape.g > 1:
    p[1] = 0.0
  return rng.multinomial(int(0.97 * shape.m), p / p.sum()).astype(np.int32)


def operands(shape: Shape, seed: int = 0):
  """Activations with per-token scales spread over 2^-3..2^3; weights ~ N(0, 1/K)."""
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((shape.m, shape.k), np.float32)
  lhs *= np.exp2(rng.uniform(-3, 3, (shape.m, 1))).astype(np.float32)
  rhs = rng.standard_normal((shape.g, shape.k, shape.n), np.float32) / np.sqrt(shape.k)
  grad = rng.standard_normal((shape.m, shape.n), np.float32)
  return lhs, rhs.astype(np.float32), grad


def _ragged_f64(lhs, rhs, sizes):
  """Float64 ground truth, one group at a time: out[rows of g] = lhs[rows] @ rhs[g]."""
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, size in enumerate(sizes):
    out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g]
    start += size
  return out


def _rel(out, ref):
  d = np.abs(np.asarray(out, np.float64) - ref)
  return d.max() / max(np.abs(ref).max(), 1e-30), d.mean() / max(np.abs(ref).mean(), 1e-30)


def _check(failures: list, what: str, value: float, limit: float) -> str:
  """Records a failure when value > limit; returns the mark printed beside the value."""
  if value <= limit:
    return ""
  failures.append(f"{what}: {value:.3e} > {limit:.1e}")
  return "  FAIL"


def error_table(shape_names, formats) -> list[str]:
  """Prints forward errors per shape and format; returns the failures (see the tolerances)."""
  import jax  # pylint: disable=import-outside-toplevel
  import pallas_kernels as pk  # pylint: disable=import-outside-toplevel
  from pallas_kernels import reference  # pylint: disable=import-outside-toplevel

  failures = []
  print("\n== errors vs float32 (kernels in interpret mode) ==")
  print(f"{'shape':16s} {'fmt':6s} {'f32 max_rel':>12s} {'f32 mean_rel':>12s} "
        f"{'spec max_rel':>12s} {'seconds':>8s}")
  for name in shape_names:
    shape = SHAPES[name]
    lhs, rhs, _ = operands(shape)
    sizes = ragged_sizes(shape)
    rows = int(sizes.sum())
    exact = _ragged_f64(lhs, rhs, sizes)[:rows]
    for fmt in formats:
      t = time.perf_counter()
      out = jax.jit(lambda a, b, s, fmt=fmt: pk.gmm(a, b, s, fmt=fmt))(lhs, rhs, sizes)
      out = np.asarray(out)[:rows]
      seconds = time.perf_counter() - t
      spec = _ragged_f64(np.asarray(reference.fake_quant_f32(lhs, fmt, 1)),
                         np.asarray(reference.fake_quant_f32(rhs, fmt, 1)), sizes)[:rows]
      f32_max, f32_mean = _rel(out, exact)
      spec_max = _rel(out, spec)[0]
      marks = (_check(failures, f"{name} {fmt} vs spec max_rel", spec_max, SPEC_MAX_REL) +
               _check(failures, f"{name} {fmt} vs f32 mean_rel", f32_mean, F32_MEAN_REL[fmt]))
      print(f"{name:16s} {fmt:6s} {f32_max:12.3e} {f32_mean:12.3e} {spec_max:12.3e} "
            f"{seconds:8.1f}{marks}", flush=True)
  return failures


def gradient_table(shape_name, formats) -> list[str]:
  """d_lhs and d_rhs with bwd_fmt = fmt, against float32 autodiff of the unquantised product;
  returns the failures (mean relative error above the format's unit roundoff)."""
  import jax  # pylint: disable=import-outside-toplevel
  import pallas_kernels as pk  # pylint: disable=import-outside-toplevel

  shape = SHAPES[shape_name]
  lhs, rhs, grad = operands(shape)
  sizes = ragged_sizes(shape)
  rows = int(sizes.sum())
  exact_dl = np.zeros_like(lhs, np.float64)
  exact_dr = np.zeros(rhs.shape)
  start = 0
  for g, size in enumerate(sizes):
    sl = slice(start, start + size)
    exact_dl[sl] = grad[sl].astype(np.float64) @ rhs[g].T
    exact_dr[g] = lhs[sl].T.astype(np.float64) @ grad[sl]
    start += size
  failures = []
  print(f"\n== gradients vs float32 ({shape_name}; backward format = forward format) ==")
  print(f"{'fmt':6s} {'d_lhs max_rel':>13s} {'d_lhs mean':>11s} {'d_rhs max_rel':>13s} "
        f"{'d_rhs mean':>11s}")
  for fmt in formats:
    def run(a, b, s, g, fmt=fmt):
      _, vjp = jax.vjp(lambda x, y: pk.gmm(x, y, s, fmt=fmt, bwd_fmt=fmt), a, b)
      return vjp(g)
    d_lhs, d_rhs = jax.jit(run)(lhs, rhs, sizes, grad)
    dl = _rel(np.asarray(d_lhs)[:rows], exact_dl[:rows])
    dr = _rel(np.asarray(d_rhs), exact_dr)
    marks = (_check(failures, f"{shape_name} {fmt} d_lhs mean_rel", dl[1], F32_MEAN_REL[fmt]) +
             _check(failures, f"{shape_name} {fmt} d_rhs mean_rel", dr[1], F32_MEAN_REL[fmt]))
    print(f"{fmt:6s} {dl[0]:13.3e} {dl[1]:11.3e} {dr[0]:13.3e} {dr[1]:11.3e}{marks}", flush=True)
  return failures


def aot_table(targets, shape_names, formats, workers: int = 2):
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU attached: loads are harmless
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  import pallas_kernels as pk  # pylint: disable=import-outside-toplevel
  from pallas_kernels import tuning  # pylint: disable=import-outside-toplevel

  def compile_one(target, name, fmt):
    device = topologies.get_topology_desc(platform="tpu",
                                          topology_name=TOPOLOGIES[target]).devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)  # without it .lower() targets CPU
    s = SHAPES[name]
    args = [jax.ShapeDtypeStruct(shp, dt, sharding=sharding) for shp, dt in
            (((s.m, s.k), jnp.bfloat16), ((s.g, s.k, s.n), jnp.bfloat16), ((s.g,), jnp.int32))]
    t = time.perf_counter()
    compiled = jax.jit(lambda a, b, c: pk.gmm(a, b, c, fmt=fmt, target=target)
                       ).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()
    return compiled.cost_analysis(), compiled.memory_analysis(), time.perf_counter() - t

  print("\n== AOT forward per TPU target (bf16 inputs; cost includes quantisation) ==")
  print(f"{'target':6s} {'shape':10s} {'fmt':6s} {'GFLOP':>8s} {'GB acc.':>8s} {'temp GB':>8s} "
        f"{'tiles':>17s} {'VMEM MiB est/limit':>18s} {'mxu':>9s} {'fp4':>6s} {'compile':>7s}")
  jobs = [(t, n, f) for t in targets for n in shape_names for f in formats]
  # XLA compiles outside the GIL: two threads keep both cores busy.
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = [pool.submit(compile_one, *job) for job in jobs]
    for (target, name, fmt), future in zip(jobs, futures):
      cost, mem, seconds = future.result()
      s, gen = SHAPES[name], tuning.get_generation(target)
      tiles = tuning.select_tiles("gmm", gen, s.m, s.k, s.n, s.g, fmt, 2)
      vmem = tuning.vmem_bytes("gmm", tiles, fmt, 2) / 2**20
      fp4 = "-" if fmt != "nvfp4" else "packed" if tuning.fp4_packed(gen, fmt) else "f4"
      mxu = jnp.dtype(tuning.mxu_dtype(gen, fmt)).name.replace("float8_", "")
      print(f"{target:6s} {name:10s} {fmt:6s} {cost['flops'] / 1e9:8.1f} "
            f"{cost['bytes accessed'] / 1e9:8.2f} {mem.temp_size_in_bytes / 1e9:8.2f} "
            f"{str(tiles):>17s} {vmem:8.1f}/{gen.vmem_limit_bytes / 2**20:<9.0f} "
            f"{mxu:>9s} {fp4:>6s} {seconds:6.1f}s", flush=True)


def _time(fn, *args, iters=10):
  import jax  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def throughput_table(shape_names, formats):
  """On a TPU: pk.gmm (quantisation included) beside jax.lax.ragged_dot, useful TFLOP/s."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import pallas_kernels as pk  # pylint: disable=import-outside-toplevel

  print(f"\n== throughput on {jax.devices()[0].device_kind} (median of 10) ==")
  print(f"{'shape':10s} {'op':16s} {'ms':>8s} {'TFLOP/s':>8s} {'vs ragged_dot':>13s}")
  for name in shape_names:
    s = SHAPES[name]
    lhs, rhs, _ = operands(s)
    sizes = jnp.asarray(ragged_sizes(s))
    lhs, rhs = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)
    flops = 2 * int(sizes.sum()) * s.k * s.n
    base = _time(jax.jit(lambda a, b, c: jax.lax.ragged_dot(
        a, b, c, preferred_element_type=jnp.float32).astype(a.dtype)), lhs, rhs, sizes)
    print(f"{name:10s} {'ragged_dot bf16':16s} {base * 1e3:8.3f} {flops / base / 1e12:8.1f} "
          f"{1.0:13.2f}")
    for fmt in formats:
      t = _time(jax.jit(lambda a, b, c, fmt=fmt: pk.gmm(a, b, c, fmt=fmt)), lhs, rhs, sizes)
      print(f"{name:10s} {'pk.gmm ' + fmt:16s} {t * 1e3:8.3f} {flops / t / 1e12:8.1f} "
            f"{base / t:13.2f}", flush=True)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m c2.bench gmm",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--formats", default=",".join(FORMATS))
  parser.add_argument("--error-shapes", default="small,kimi_up_slice",
                      help="also: kimi_down_slice")
  parser.add_argument("--aot-shapes", default="kimi_up", help="also: kimi_down, small")
  parser.add_argument("--targets", default=",".join(TOPOLOGIES))
  parser.add_argument("--skip-errors", action="store_true")
  parser.add_argument("--skip-aot", action="store_true")
  args = parser.parse_args(argv)
  split = lambda v: [x for x in v.split(",") if x]
  formats = split(args.formats)
  import jax  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  if jax.default_backend() == "tpu":
    throughput_table(["small", "kimi_up", "kimi_down"], formats)
  elif jax.default_backend() != "cpu":
    print(f"{jax.default_backend()}: the kernels are Pallas TPU kernels and would only run in "
          "interpret mode here, which is no speed measurement; run on a TPU or on CPU.")
  failures = []
  if jax.default_backend() != "tpu" and not args.skip_errors:
    failures += error_table(split(args.error_shapes), formats)
    failures += gradient_table("small", formats)
  if not args.skip_aot:
    try:
      import libtpu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      print("\nlibtpu not installed (pip install 'jax[tpu]'): skipping the AOT table")
    else:
      aot_table(split(args.targets), split(args.aot_shapes), formats)
  print(f"\ntotal {time.perf_counter() - start:.0f}s")
  for failure in failures:
    print(f"FAILED {failure}")
  return 1 if failures else 0
