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
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment file[:variant]",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (checkpoints, tb, logs)")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the job")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index")
_MULTIHOST = flags.DEFINE_bool("multihost", None,
                               "call jax.distributed.initialize() (default: on TPU pods)")


def _maybe_initialize_distributed() -> None:
  import jax  # pylint: disable=import-outside-toplevel
  if _COORDINATOR.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  elif _MULTIHOST.value or (_MULTIHOST.value is None and os.environ.get("TPU_WORKER_HOSTNAMES",
                                                                          "").count(",") > 0):
    jax.distributed.initialize()


def main(argv) -> None:
  del argv
  if _CONFIG.value is None or _WORKDIR.value is None:
    sys.exit("usage: python -m c2.main --config experiments/<phase>.py:<variant> --workdir DIR")
  logging.basicConfig(level=logging.WARNING)
  absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every file at INFO
  _maybe_initialize_distributed()
  import jax  # pylint: disable=import-outside-toplevel
  from c2 import config as config_lib, train  # pylint: disable=import-outside-toplevel
  try:
    exp = config_lib.from_config_dict(_CONFIG.value)
    exp.validate_for_devices(jax.device_count())
  except config_lib.ConfigError as e:
    sys.exit(f"config error: {e}")
  with jax.transfer_guard_device_to_host("allow"):
    train.run(exp, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
