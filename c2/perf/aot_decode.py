"""Prove from a CPU host that the serving decode step compiles and fits on a TPU topology.

  python -m c2.perf.aot_decode --preset kimi-k2.5 --topology v5p:4x4x8 --slots 512 \
      --capacity 131072 [--mesh expert=128] [--cache-dtype bfloat16]
  compile_decode(cfg, "v5p:4x4x8", slots=512, capacity=131072) -> DecodeReport

Lowers `c2.infer.steps.decode` (one token for every slot of the latent KV cache) exactly as the
engine jits it: the cache donated, the params placed by `c2.model.param_shardings`, the cache by
`c2.infer.cache.cache_shardings`, both from the logical RULES table, on a compile-only mesh of the
topology's TPU devices (c2.perf.aot.topology_devices; libtpu, no TPU needed). Reports per device
the params' and the cache's share of HBM, XLA's memory analysis (arguments, temporaries, total
against the chip's HBM) and the cache bytes per token. Exits 1 when it does not fit.

Serving params are bf16 (`param_dtype="bfloat16"`: 1.04T x 2 bytes = 2.1 TB for kimi-k2.5), layers
unrolled as the engine runs them (`--scanned-layers` compiles the layer scan instead: faster to
compile, but XLA copies the stacked cache around the scan).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding

import pallas_kernels
from c2 import model
from c2.infer import cache as cache_lib
from c2.infer import steps
from c2.model.config import ModelConfig
from c2.parallel import mesh as meshlib
from c2.parallel import sharding
from c2.perf import aot, hardware

# The production matmul precision (as c2.train.program pins it for the train step).
MATMUL_PRECISION = "default"
SERVING_DTYPES = {"dtype": "bfloat16", "param_dtype": "bfloat16"}


@dataclasses.dataclass
class DecodeReport(aot.HbmUse):
  preset: str
  topology: str
  platform: str  # of the compiled executable's devices: must be "tpu"
  num_devices: int
  mesh: dict
  slots: int
  capacity: int
  cache_bytes_per_token: int  # trunk cache, all layers (c2.infer.cache.bytes_per_token)
  param_bytes: int  # per device, from the param shardings
  cache_bytes: int  # per device, from the cache shardings
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int
  hbm_bytes: int
  collectives: dict
  compile_seconds: float

  def format(self) -> str:
    gib = lambda b: f"{b / 2**30:8.2f} GiB"
    tokens = self.slots * self.capacity
    return "\n".join([
        f"decode {self.preset}  topology {self.topology} ({self.platform})  devices "
        f"{self.num_devices}  mesh {self.mesh}",
        f"  slots x capacity  {self.slots} x {self.capacity} = {tokens:,} cached tokens",
        f"  cache per token   {self.cache_bytes_per_token:,} B (all layers)",
        f"  params       {gib(self.param_bytes)}  (per device, from the shardings)",
        f"  cache        {gib(self.cache_bytes)}",
        *self.memory_lines(),
        "  collectives  " + ", ".join(f"{k} {v}" for k, v in self.collectives.items()),
        f"  compile time {self.compile_seconds:.1f} s",
    ])


def serving_config(preset: str, **overrides) -> ModelConfig:
  """The preset as the engine serves it: bf16 params and compute, unrolled layers (Engine's
  default scan_layers=False)."""
  return model.get_preset(preset, **{**SERVING_DTYPES, "scan_layers": False, **overrides})


def _shard_bytes(abstract, shardings) -> int:
  """Bytes one device holds of a tree of arrays under its shardings (the largest shard)."""
  leaves = zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
  return sum(math.prod(s.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize for a, s in leaves)


def lower_decode(cfg: ModelConfig, mesh: jax.sharding.Mesh, slots: int, capacity: int, *,
                 cache_dtype=None, target_generation: Optional[str] = None,
                 auto_cache_layout: bool = False):
  """(lowered decode step, abstract params, abstract cache) on `mesh`, all arguments sharded.

  auto_cache_layout: let XLA choose the caches' HBM layout. Only matters for a scanned cfg
  (scan_layers=True): TPU's default layout for a [Y, N, S, 576] stack makes XLA copy the whole
  stack around the layer scan (temporaries = one more cache); with unrolled layers (the engine's
  default) each layer's [N, S, 576] array is read and written in place and the default layout
  needs no copy. The engine would have to allocate the cache in `compiled.input_formats` to run
  an executable compiled with this flag.
  """
  param_sh = model.param_shardings(cfg, mesh)
  params = sharding.with_shardings(model.abstract_params(cfg), param_sh)
  cache = cache_lib.abstract_cache(cfg, slots, capacity, 0, cache_dtype, mesh)
  cache_sh = jax.tree.map(lambda a: a.sharding, cache)
  if auto_cache_layout:
    cache_sh = cache_sh.replace(stacks=jax.tree.map(lambda s: Format(Layout.AUTO, s),
                                                    cache_sh.stacks))
  slot_sh = NamedSharding(mesh, sharding.logical_to_spec(cache_lib.SLOT_AXES, (slots,),
                                                         dict(mesh.shape)))
  vector = lambda dtype: jax.ShapeDtypeStruct((slots,), dtype, sharding=slot_sh)
  sampling = {"temperature": vector(jnp.float32), "top_k": vector(jnp.int32),
              "top_p": vector(jnp.float32), "seed": vector(jnp.uint32)}
  decode = jax.jit(functools.partial(steps.decode, cfg=cfg),
                   in_shardings=(param_sh, cache_sh, slot_sh, slot_sh,
                                 {k: slot_sh for k in sampling}),
                   out_shardings=(cache_sh, slot_sh, slot_sh, None), donate_argnums=1,
                   # The engine holds every param in HBM, the MTP modules' too (decode does not
                   # read them): keep them as arguments so the memory analysis counts them.
                   keep_unused=True)
  target = (pallas_kernels.use_target(target_generation) if target_generation
            else _null())
  with jax.set_mesh(mesh), target, jax.default_matmul_precision(MATMUL_PRECISION):
    lowered = decode.lower(params, cache, vector(jnp.int32), vector(jnp.bool_), sampling)
  return lowered, params, cache


def _null():
  import contextlib  # pylint: disable=import-outside-toplevel
  return contextlib.nullcontext()


def compiled_platform(compiled) -> str:
  """The platform of the devices the executable was built for ('tpu', or 'cpu' when the
  arguments carried no TPU sharding: see research/tooling.md 7, GOTCHA)."""
  shardings = jax.tree.leaves(compiled.input_shardings)
  return next(iter(shardings[0].device_set)).platform


def compile_decode(cfg: ModelConfig, topology: str, slots: int, capacity: int, *,
                   mesh_axes: Optional[dict] = None, cache_dtype=None,
                   preset: str = "", auto_cache_layout: bool = False) -> DecodeReport:
  """Compiles the decode step for `topology` (default mesh: every device on `expert`)."""
  topology = hardware.resolve_topology(topology)
  devices = aot.topology_devices(topology)
  mesh = meshlib.make_mesh(mesh_axes or {"expert": -1}, devices=devices)
  start = time.time()
  lowered, params, cache = lower_decode(cfg, mesh, slots, capacity, cache_dtype=cache_dtype,
                                        target_generation=topology.split(":")[0].lower(),
                                        auto_cache_layout=auto_cache_layout)
  try:
    with jax.set_mesh(mesh):
      compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise aot.DoesNotFit(f"decode {slots} x {capacity} on {topology} (mesh "
                         f"{dict(mesh.shape)}): {str(e).splitlines()[0]}") from None
  elapsed = time.time() - start
  return DecodeReport(
      preset=preset, topology=topology, platform=compiled_platform(compiled),
      num_devices=mesh.size, mesh={k: v for k, v in mesh.shape.items() if v > 1},
      slots=slots, capacity=capacity,
      cache_bytes_per_token=cache_lib.bytes_per_token(cfg, cache_dtype or cfg.dtype),
      param_bytes=_shard_bytes(params, jax.tree.map(lambda a: a.sharding, params)),
      cache_bytes=_shard_bytes(cache, jax.tree.map(lambda a: a.sharding, cache)),
      **aot.HbmUse.fields_of(compiled), hbm_bytes=hardware.chip_of_topology(topology).hbm_bytes,
      collectives=aot.count_collectives(compiled.as_text()), compile_seconds=elapsed)


def parse_mesh(text: Optional[str]) -> Optional[dict]:
  """'expert=32,tensor=4' -> {'expert': 32, 'tensor': 4} (one axis may be -1)."""
  if not text:
    return None
  pairs = [item.split("=") for item in text.split(",") if item]
  if any(len(p) != 2 for p in pairs):
    raise ValueError(f"--mesh takes axis=size pairs such as expert=32,tensor=4, got {text!r}")
  return {name.strip(): int(size) for name, size in pairs}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m c2.perf.aot_decode",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="kimi-k2.5")
  parser.add_argument("--topology", default="v5p:4x4x8", help="v5p:4x4x8 or v5p-256")
  parser.add_argument("--slots", type=int, required=True)
  parser.add_argument("--capacity", type=int, required=True)
  parser.add_argument("--mesh", default=None, help="axis=size,... (default expert=-1)")
  parser.add_argument("--cache-dtype", default=None, help="default: the compute dtype (bf16)")
  parser.add_argument("--auto-cache-layout", action="store_true",
                      help="let XLA pick the cache's HBM layout (no copy around the layer scan)")
  parser.add_argument("--scanned-layers", action="store_true",
                      help="the layer scan over stacked params and caches instead of the "
                           "engine's default, one module and one cache array per layer")
  return parser.parse_args(sys.argv[1:] if argv is None else argv)


def main(argv: Optional[list[str]] = None) -> int:
  args = parse_args(argv)
  # Compile-only libtpu (as c2.aot): no metadata server, several AOT processes per host.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  try:
    cfg = serving_config(args.preset, scan_layers=args.scanned_layers)
    report = compile_decode(cfg, args.topology, args.slots, args.capacity,
                            mesh_axes=parse_mesh(args.mesh), cache_dtype=args.cache_dtype,
                            preset=args.preset, auto_cache_layout=args.auto_cache_layout)
  except aot.DoesNotFit as e:
    print(f"DOES NOT FIT: {e}", flush=True)
    return 1
  print(report.format(), flush=True)
  if report.platform != "tpu":
    print(f"ERROR: compiled for {report.platform}, not TPU", file=sys.stderr)
    return 1
  return 0 if report.fits else 1


if __name__ == "__main__":
  sys.exit(main())
