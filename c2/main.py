"""Entry point: `python -m c2.main --config experiments/pretrain.py:tiny --workdir runs/tiny`.

The same command runs on one CPU and on every host of a TPU pod. `--config.a.b=v` overrides any
field of the experiment file. Multi-host: on TPU pods `jax.distributed.initialize()` discovers the
cluster itself; elsewhere pass --coordinator_address, --num_processes and --process_id.
"""
from __future__ import annotations

import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging

from c2 import cli


def define_flags(flag_values, argv=None) -> None:
  cli.define_config_flag(flag_values, argv, lock_config=True)
  flags.DEFINE_string("workdir", None, "run directory (checkpoints, tb, logs)",
                      flag_values=flag_values)
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0",
                      flag_values=flag_values)
  flags.DEFINE_integer("num_processes", None, "processes in the job", flag_values=flag_values)
  flags.DEFINE_integer("process_id", None, "this process's index", flag_values=flag_values)
  flags.DEFINE_bool("multihost", None, "call jax.distributed.initialize() (default: on TPU pods)",
                    flag_values=flag_values)


def parse(argv: list[str]):
  """(ExperimentConfig, flag values) of a `python -m c2.main ...` argv, as `main` parses it."""
  return cli.parse_command(argv, define_flags)


define_flags(flags.FLAGS)
FLAGS = flags.FLAGS


def _maybe_initialize_distributed() -> None:
  import jax  # pylint: disable=import-outside-toplevel
  if FLAGS.coordinator_address:
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address,
                               num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)
  elif FLAGS.multihost or (FLAGS.multihost is None and
                           os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0):
    jax.distributed.initialize()


def main(argv) -> None:
  del argv
  if FLAGS.config is None or FLAGS.workdir is None:
    sys.exit("usage: python -m c2.main --config experiments/<phase>.py:<variant> --workdir DIR")
  logging.basicConfig(level=logging.WARNING)
  absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every file at INFO
  _maybe_initialize_distributed()
  import jax  # pylint: disable=import-outside-toplevel
  from c2 import config as config_lib  # pylint: disable=import-outside-toplevel
  from c2.train import loop  # pylint: disable=import-outside-toplevel
  try:
    exp = config_lib.from_config_dict(FLAGS.config)
    exp.validate_for_devices(jax.device_count())
  except config_lib.ConfigError as e:
    sys.exit(f"config error: {e}")
  if exp.phase == "rl":
    from c2.rl import learner  # pylint: disable=import-outside-toplevel
    learner.run(exp, FLAGS.workdir)
  else:
    loop.run(exp, FLAGS.workdir)


if __name__ == "__main__":
  app.run(main)
