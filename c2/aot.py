"""Prove from a CPU host that an experiment's train step compiles and fits on its TPU topology.

  python -m c2.aot --config experiments/pretrain.py:full [--topology v5p:16x16x16] [--num-slices 2]

Compiles the trainer's own program (c2.train.program) for a compile-only TPU mesh (libtpu, no
TPU needed; c2.perf.aot) and prints per-device HBM against the chip's, compiled matmul FLOPs and
their ratio to the analytic useful FLOPs, and the collectives. Exits 1 when it does not fit.
--topology takes a topology (v5p:4x4x8) or an accelerator type (v5p-256, v6e-64, tpu7x-128) and
defaults to the experiment's `aot.topology`; --num-slices N is `--config.mesh.num_slices=N`.

  python -m c2.aot --decode --preset kimi-k2.5 --topology v5p:4x4x8 --slots 512 --capacity 131072

compiles the serving decode step instead (c2.perf.aot_decode; --help there).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

from absl import flags

from c2 import cli


def define_flags(flag_values, argv=None) -> None:
  cli.define_config_flag(flag_values, argv, lock_config=True)
  flags.DEFINE_string("topology", None, "v5p:16x16x16 or v5p-8192 (default: the experiment's)",
                      flag_values=flag_values)
  flags.DEFINE_integer("num_slices", None, "slices over DCN (sets config.mesh.num_slices)",
                       flag_values=flag_values)
  flags.DEFINE_alias("num-slices", "num_slices", flag_values=flag_values)  # gcloud/xpk spelling


def parse(argv: list[str]):
  """(ExperimentConfig, topology) of a `python -m c2.aot ...` argv; the topology resolved."""
  from c2.perf import hardware  # pylint: disable=import-outside-toplevel
  exp, values = cli.parse_command(argv, define_flags)
  if values["num_slices"].value:
    exp = dataclasses.replace(exp, mesh=dataclasses.replace(
        exp.mesh, num_slices=values["num_slices"].value))
  return exp, hardware.resolve_topology(values["topology"].value or exp.aot.topology)


def main(argv: Optional[list[str]] = None) -> int:
  argv = sys.argv if argv is None else argv
  if "--decode" in argv[1:]:  # the serving decode step: its own flags (c2.perf.aot_decode)
    from c2.perf import aot_decode  # pylint: disable=import-outside-toplevel
    return aot_decode.main([a for a in argv[1:] if a != "--decode"])
  if any(a in ("-h", "--help") for a in argv[1:]):
    print(__doc__.strip())
    return 0
  # Compile-only use of libtpu: several AOT processes may share one host.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # No TPU VM around: without these libtpu asks the GCE metadata server and logs an alarming
  # INVALID_ARGUMENT about worker hostnames (harmless for compiling, but it reads like a failure).
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  from c2 import config as config_lib  # pylint: disable=import-outside-toplevel
  from c2.perf import aot  # pylint: disable=import-outside-toplevel
  try:
    exp, topology = parse(argv)
  except (flags.Error, config_lib.ConfigError, ValueError) as e:
    print(f"error: {e}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2
  try:
    report = aot.compile_step(exp, topology)
  except aot.DoesNotFit as e:
    print(f"DOES NOT FIT: {e}", flush=True)
    return 1
  print(report.format(), flush=True)
  return 0 if report.fits else 1


if __name__ == "__main__":
  sys.exit(main())
