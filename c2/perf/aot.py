"""Prove from a CPU host that an experiment's train step compiles and fits on its TPU topology.

  compile_step(exp, "v5p:16x16x16") -> AotReport      (the CLI is `python -m c2.aot`)

Builds the run's program (c2.train.program: the trainer's step, shardings and abstract state) on
a compile-only TPU mesh (libtpu, no TPU needed), compiles it, and reports per-device HBM
(arguments, temporaries, outputs, total vs the chip's capacity), compiled matmul FLOPs
(c2.perf.hlo_flops: every dot, convolution and Mosaic kernel of the optimized HLO, loops times
their trip counts) and their ratio to the analytic useful FLOPs (6 x active params x tokens plus
attention), and the count of each collective and the bytes each device puts into them per step
(c2.perf.hlo_collectives).
"""
from __future__ import annotations

import dataclasses
import re
import time

import jax

from c2.config import ExperimentConfig
from c2.ops import splash_attention  # also registers the splash kernels' FLOP rule
from c2.parallel import mesh as meshlib
from c2.perf import flops, hardware, hlo_collectives, hlo_flops
from c2.train import program as program_lib

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")


class DoesNotFit(RuntimeError):
  """XLA refused to compile: the program needs far more HBM than the chip has."""


class HbmUse:
  """Peak HBM per device of a compiled executable, shared by the train-step and decode reports.
  A plain mixin: each report declares the byte fields below as its own dataclass fields."""

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int
  hbm_bytes: int

  @staticmethod
  def fields_of(compiled) -> dict:
    """The byte fields from `compiled.memory_analysis()` (hbm_bytes comes from the chip)."""
    memory = compiled.memory_analysis()
    return dict(argument_bytes=memory.argument_size_in_bytes,
                output_bytes=memory.output_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
                temp_bytes=memory.temp_size_in_bytes,
                code_bytes=memory.generated_code_size_in_bytes)

  @property
  def total_bytes(self) -> int:
    """Peak HBM per device: live arguments (donated outputs alias them) + temporaries + code."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + \
        self.code_bytes

  @property
  def fits(self) -> bool:
    return self.total_bytes <= self.hbm_bytes

  def memory_lines(self) -> list[str]:
    gib = lambda b: f"{b / 2**30:8.2f} GiB"
    return [
        f"  arguments    {gib(self.argument_bytes)}",
        f"  outputs      {gib(self.output_bytes)}  (aliased with arguments: "
        f"{gib(self.alias_bytes).strip()})",
        f"  temporaries  {gib(self.temp_bytes)}",
        f"  code         {gib(self.code_bytes)}",
        f"  total        {gib(self.total_bytes)}  of {gib(self.hbm_bytes).strip()} HBM "
        f"({self.total_bytes / self.hbm_bytes:.0%}) -> {'FITS' if self.fits else 'DOES NOT FIT'}",
    ]


@dataclasses.dataclass
class AotReport(HbmUse):
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
  compiled_flops: float  # per device: matmul FLOPs of the optimized HLO (c2.perf.hlo_flops)
  useful_flops: float  # per device, analytic
  flops_by_kind: dict  # "xla dot/convolution", "kernel <name>" -> per-device FLOPs
  flops_by_op: dict  # jax op name (named scopes, transpose(...) = backward) -> per-device FLOPs
  xla_cost_flops: float  # XLA's cost_analysis (counts each while body once; for reference)
  unknown_trip_count_loops: list
  uncounted_kernels: list
  collectives: dict
  compile_seconds: float
  # kind -> bytes per device per step, loops times their trip counts (c2.perf.hlo_collectives)
  collective_bytes: dict = dataclasses.field(default_factory=dict)
  # compiled_flops with splash recounted at head dims rounded up to 128 lanes: the MXU-time
  # upper bound for 192-wide q/k heads (splash_attention.flops_at_lane_heads)
  flops_at_lane_heads: float = float("nan")

  @property
  def flop_ratio(self) -> float:
    return self.compiled_flops / self.useful_flops if self.useful_flops else float("nan")

  def format(self) -> str:
    gib = lambda b: f"{b / 2**30:8.2f} GiB"
    lines = [
        f"phase {self.phase}  topology {self.topology} x{self.num_slices}  "
        f"devices {self.num_devices}  mesh {self.mesh}",
        *self.memory_lines(),
        f"  FLOPs/device compiled {self.compiled_flops:.3e}  useful {self.useful_flops:.3e}  "
        f"ratio {self.flop_ratio:.3f}  (splash at 128-lane head dims: "
        f"{self.flops_at_lane_heads / self.useful_flops:.3f})",
        *(f"    {kind:44s} {value:.3e}  ({value / self.compiled_flops:.1%})"
          for kind, value in sorted(self.flops_by_kind.items(), key=lambda kv: -kv[1])),
        f"    (XLA cost_analysis, while bodies counted once: {self.xla_cost_flops:.3e})",
        *([f"  WARNING loops of unknown trip count, counted once: "
           f"{self.unknown_trip_count_loops}"] if self.unknown_trip_count_loops else []),
        *([f"  WARNING kernels with no FLOP count: {self.uncounted_kernels}"]
          if self.uncounted_kernels else []),
        "  collectives  " + ", ".join(f"{k} {v}" for k, v in self.collectives.items()),
        *([f"  collective bytes/device/step {sum(self.collective_bytes.values()) / 2**30:.2f} GiB: "
           + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in self.collective_bytes.items() if v)]
          if self.collective_bytes else []),
        f"  compile time {self.compile_seconds:.1f} s",
    ]
    return "\n".join(lines)


def topology_devices(topology: str, num_slices: int = 1) -> list:
  """The compile-only devices of `num_slices` slices of `topology` (e.g. 'v5p:4x4x8')."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  hardware.chip_of_topology(topology)  # validates the generation name with a clear error
  kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
  devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                              **kwargs).devices)
  if devices[0].platform != "tpu":
    raise RuntimeError("topology devices are not TPU devices: is libtpu installed? "
                       "pip install -e '.[tpu]'")
  return devices


def count_collectives(hlo_text: str) -> dict:
  """Occurrences of each collective op in optimized HLO (async start/done pairs count once)."""
  counts = {}
  for name in COLLECTIVES:
    pattern = rf"\s{re.escape(name)}(-start)?\("
    counts[name] = len(re.findall(pattern, hlo_text))
  return counts


def compile_step(exp: ExperimentConfig, topology: str) -> AotReport:
  """Compiles the experiment's train step for `exp.mesh.num_slices` slices of `topology`."""
  program, elapsed, compiled = lower_and_compile(exp, topology)
  return report_of(compiled, exp, topology, program.mesh, elapsed)


def program_on(exp: ExperimentConfig, devices: list, target_generation=None):
  """The run's program (c2.train.program.build, as the trainer builds it) on `devices`."""
  mesh = meshlib.make_mesh(exp.validate_for_devices(len(devices)), devices=devices,
                           num_slices=exp.mesh.num_slices)
  return program_lib.build(exp, mesh, target_generation=target_generation)


def tpu_program(exp: ExperimentConfig, topology: str) -> program_lib.Program:
  """The run's program on a compile-only mesh of `exp.mesh.num_slices` slices of `topology`."""
  # Pallas kernels pick their tiles and native formats by TPU generation: the target's, not
  # this host's.
  return program_on(exp, topology_devices(topology, exp.mesh.num_slices),
                    target_generation=topology.split(":")[0].lower())


def lower_and_compile(exp: ExperimentConfig, topology: str):
  """(program, compile seconds, compiled executable) of the train step on `topology`."""
  program = tpu_program(exp, topology)
  start = time.time()
  lowered = program.lower()
  try:
    with program.context():
      compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    # Far over the chip's HBM, XLA gives up before producing a program to measure.
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise DoesNotFit(f"{exp.phase} on {topology} (mesh {dict(program.mesh.shape)}) does not fit: "
                     f"{str(e).splitlines()[0]}") from None
  return program, time.time() - start, compiled


def report_of(compiled, exp: ExperimentConfig, topology: str, mesh: jax.sharding.Mesh,
              elapsed: float) -> AotReport:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hlo_text = compiled.as_text()
  matmul = hlo_flops.count_flops(hlo_text)
  tokens = exp.data.global_batch_size * exp.data.seq_len
  useful = flops.train_flops_per_token(exp.model, exp.data.seq_len) * tokens / mesh.size
  chip = hardware.chip_of_topology(topology)
  return AotReport(
      phase=exp.phase, topology=topology, num_slices=exp.mesh.num_slices, num_devices=mesh.size,
      mesh=dict(mesh.shape), **HbmUse.fields_of(compiled), hbm_bytes=chip.hbm_bytes,
      compiled_flops=matmul.total, useful_flops=useful, flops_by_kind=matmul.by_kind,
      flops_by_op=matmul.by_op_name, xla_cost_flops=float(cost.get("flops", 0.0)),
      unknown_trip_count_loops=matmul.unknown_trip_count_loops,
      uncounted_kernels=matmul.uncounted_kernels, collectives=count_collectives(hlo_text),
      compile_seconds=elapsed,
      collective_bytes=hlo_collectives.count_collective_bytes(hlo_text),
      flops_at_lane_heads=splash_attention.flops_at_lane_heads(
          matmul.by_kind, exp.model.qk_head_dim, exp.model.v_head_dim,
          exp.model.splash_fused_backward))
