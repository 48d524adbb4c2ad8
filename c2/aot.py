"""Prove from a CPU host that an experiment's train step compiles and fits on its TPU topology.

  python -m c2.aot --config experiments/pretrain.py:full [--topology v5p:16x16x16] [--num-slices 2]

Builds the abstract train state and batch with their shardings on a compile-only TPU mesh (libtpu,
no TPU needed), lowers and compiles the phase's real step, and prints per-device HBM (arguments,
temporaries, outputs, total vs the chip's capacity), compiled matmul FLOPs (c2.hlo_flops: every
dot, convolution and Mosaic kernel of the optimized HLO, loops times their trip counts) and their
ratio to the analytic useful FLOPs (6 x active params x tokens plus attention), and the count of
each collective. Exits 1 when the program does not fit. The topology defaults to the experiment's
`aot.topology`. The phase's step comes from `c2.steps.STEPS`, like the trainer's.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from c2 import flops, hardware, hlo_flops
from c2 import mesh as meshlib
from c2 import state as state_lib
from c2 import train
from c2.config import ExperimentConfig
from c2.data import loader
from c2.ops import splash_attention  # noqa: F401  registers the splash kernels' FLOP rule

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")


class DoesNotFit(RuntimeError):
  """XLA refused to compile: the program needs far more HBM than the chip has."""


@dataclasses.dataclass
class AotReport:
  phase: str
  topology: str
  num_slices: int
  num_devices: int
  mesh: dict
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int
  hbm_bytes: int
  compiled_flops: float  # per device: matmul FLOPs of the optimized HLO (c2.hlo_flops)
  useful_flops: float  # per device, analytic
  flops_by_kind: dict  # "xla dot/convolution", "kernel <name>" -> per-device FLOPs
  flops_by_op: dict  # jax op name (named scopes, transpose(...) = backward) -> per-device FLOPs
  xla_cost_flops: float  # XLA's cost_analysis (counts each while body once; for reference)
  unknown_trip_count_loops: list
  uncounted_kernels: list
  collectives: dict
  compile_seconds: float

  @property
  def total_bytes(self) -> int:
    """Peak HBM per device: live arguments (donated outputs alias them) + temporaries + code."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + \
        self.code_bytes

  @property
  def fits(self) -> bool:
    return self.total_bytes <= self.hbm_bytes

  @property
  def flop_ratio(self) -> float:
    return self.compiled_flops / self.useful_flops if self.useful_flops else float("nan")

  def format(self) -> str:
    gib = lambda b: f"{b / 2**30:8.2f} GiB"
    lines = [
        f"phase {self.phase}  topology {self.topology} x{self.num_slices}  "
        f"devices {self.num_devices}  mesh {self.mesh}",
        f"  arguments    {gib(self.argument_bytes)}",
        f"  outputs      {gib(self.output_bytes)}  (aliased with arguments: "
        f"{gib(self.alias_bytes).strip()})",
        f"  temporaries  {gib(self.temp_bytes)}",
        f"  code         {gib(self.code_bytes)}",
        f"  total        {gib(self.total_bytes)}  of {gib(self.hbm_bytes).strip()} HBM "
        f"({self.total_bytes / self.hbm_bytes:.0%}) -> {'FITS' if self.fits else 'DOES NOT FIT'}",
        f"  FLOPs/device compiled {self.compiled_flops:.3e}  useful {self.useful_flops:.3e}  "
        f"ratio {self.flop_ratio:.3f}",
        *(f"    {kind:44s} {value:.3e}  ({value / self.compiled_flops:.1%})"
          for kind, value in sorted(self.flops_by_kind.items(), key=lambda kv: -kv[1])),
        f"    (XLA cost_analysis, while bodies counted once: {self.xla_cost_flops:.3e})",
        *([f"  WARNING loops of unknown trip count, counted once: "
           f"{self.unknown_trip_count_loops}"] if self.unknown_trip_count_loops else []),
        *([f"  WARNING kernels with no FLOP count: {self.uncounted_kernels}"]
          if self.uncounted_kernels else []),
        "  collectives  " + ", ".join(f"{k} {v}" for k, v in self.collectives.items()),
        f"  compile time {self.compile_seconds:.1f} s",
    ]
    return "\n".join(lines)


def topology_devices(topology: str, num_slices: int = 1) -> list:
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  hardware.chip_of_topology(topology)  # validates the generation name with a clear error
  kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
  return list(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                           **kwargs).devices)


def _pallas_target(generation: str):
  import contextlib  # pylint: disable=import-outside-toplevel
  try:
    import pallas_kernels  # pylint: disable=import-outside-toplevel
  except ImportError:
    return contextlib.nullcontext()
  return pallas_kernels.use_target(generation)


def count_collectives(hlo_text: str) -> dict:
  """Occurrences of each collective op in optimized HLO (async start/done pairs count once)."""
  counts = {}
  for name in COLLECTIVES:
    pattern = rf"\s{re.escape(name)}(-start)?\("
    counts[name] = len(re.findall(pattern, hlo_text))
  return counts


def compile_step(exp: ExperimentConfig, topology: str, num_slices: int = 1) -> AotReport:
  compiled, devices, mesh, elapsed = lower_and_compile(exp, topology, num_slices)
  return report_of(compiled, exp, topology, num_slices, devices, mesh, elapsed)


def lower_and_compile(exp: ExperimentConfig, topology: str, num_slices: int = 1):
  """The phase's train step compiled for `topology`: (compiled, devices, mesh, seconds)."""
  devices = topology_devices(topology, num_slices)
  if devices[0].platform != "tpu":
    raise RuntimeError("topology devices are not TPU devices: is libtpu installed? "
                       "pip install -e '.[tpu]'")
  axis_sizes = exp.validate_for_devices(len(devices))
  mesh = meshlib.make_mesh(axis_sizes, devices=devices, num_slices=num_slices)
  opt = train.make_optimizer(exp)
  abstract = state_lib.abstract_state(exp.model, opt.tx)
  shardings = state_lib.state_shardings(exp.model, opt.tx, mesh)
  state_in = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  batch_shape = (exp.data.global_batch_size, exp.data.seq_len)
  batch_sharding = loader.batch_sharding(mesh, batch_shape)
  dtypes = {"tokens": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
            "loss_mask": jnp.float32}
  batch_in = {k: jax.ShapeDtypeStruct(batch_shape, dtypes[k], sharding=batch_sharding)
              for k in loader.BATCH_KEYS}
  step = jax.jit(train.make_train_step(exp, opt.tx, opt.schedule),
                 out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
  start = time.time()
  # Pallas kernels pick their tiles and native formats by TPU generation: the target's, not
  # this host's.
  generation = topology.split(":")[0].lower()
  # Production precision: Mosaic kernels (ragged_dot, splash) reject HIGHEST on bf16 operands.
  with jax.set_mesh(mesh), _pallas_target(generation), jax.default_matmul_precision("default"):
    lowered = step.lower(state_in, batch_in)
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      # Far over the chip's HBM, XLA gives up before producing a program to measure.
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      raise DoesNotFit(f"{exp.phase} on {topology} (mesh {dict(mesh.shape)}) does not fit: "
                       f"{str(e).splitlines()[0]}") from None
  return compiled, devices, mesh, time.time() - start


def report_of(compiled, exp: ExperimentConfig, topology: str, num_slices: int, devices: list,
              mesh, elapsed: float) -> AotReport:
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hlo_text = compiled.as_text()
  matmul = hlo_flops.count_flops(hlo_text)
  tokens = exp.data.global_batch_size * exp.data.seq_len
  useful = flops.train_flops_per_token(exp.model, exp.data.seq_len) * tokens / len(devices)
  chip = hardware.chip_of_topology(topology)
  return AotReport(
      phase=exp.phase, topology=topology, num_slices=num_slices, num_devices=len(devices),
      mesh=dict(mesh.shape), argument_bytes=memory.argument_size_in_bytes,
      output_bytes=memory.output_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
      temp_bytes=memory.temp_size_in_bytes, code_bytes=memory.generated_code_size_in_bytes,
      hbm_bytes=chip.hbm_bytes, compiled_flops=matmul.total, useful_flops=useful,
      flops_by_kind=matmul.by_kind, flops_by_op=matmul.by_op_name, xla_cost_flops=float(cost.get("flops", 0.0)),
      unknown_trip_count_loops=matmul.unknown_trip_count_loops,
      uncounted_kernels=matmul.uncounted_kernels, collectives=count_collectives(hlo_text),
      compile_seconds=elapsed)


def main(argv: Optional[list[str]] = None) -> int:
  # Compile-only use of libtpu: several AOT processes may share one host.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # No TPU VM around: without these libtpu asks the GCE metadata server and logs an alarming
  # INVALID_ARGUMENT about worker hostnames (harmless for compiling, but it reads like a failure).
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  from c2 import config as config_lib  # pylint: disable=import-outside-toplevel

  config = config_flags.DEFINE_config_file("config", None, "experiment file[:variant]")
  topology = flags.DEFINE_string("topology", None, "e.g. v5p:16x16x16 (default: the experiment's)")
  num_slices = flags.DEFINE_integer("num_slices", None, "slices (default: the experiment's)")
  flags.DEFINE_alias("num-slices", "num_slices")  # the spelling gcloud and xpk use
  result = {}

  def run(_):
    exp = config_lib.from_config_dict(config.value)
    try:
      report = compile_step(exp, topology.value or exp.aot.topology,
                            num_slices.value or exp.aot.num_slices)
    except DoesNotFit as e:
      print(f"DOES NOT FIT: {e}", flush=True)
      result["code"] = 1
      return
    print(report.format(), flush=True)
    result["code"] = 0 if report.fits else 1

  try:
    app.run(run, argv=argv or sys.argv)
  except SystemExit as e:
    if e.code not in (0, None):
      raise
  return result.get("code", 1)


if __name__ == "__main__":
  sys.exit(main())
