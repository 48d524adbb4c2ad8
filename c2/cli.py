"""Experiment files and command lines: one place that turns them into an ExperimentConfig.

  load_experiment("experiments/pretrain.py:tiny")  the file's get_config(arg), no absl flags
  parse_command(argv, define_flags)                  what c2.main / c2.aot parse, for any argv
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Optional

import ml_collections


def load_module(path: str):
  """Imports an experiment file by path; relative paths resolve from the repository root too."""
  candidates = [path, os.path.join(os.path.dirname(os.path.dirname(__file__)), path)]
  for candidate in candidates:
    if os.path.exists(candidate):
      name = "c2_experiment_" + os.path.splitext(os.path.basename(candidate))[0]
      spec = importlib.util.spec_from_file_location(name, candidate)
      module = importlib.util.module_from_spec(spec)
      sys.modules[name] = module
      spec.loader.exec_module(module)
      return module
  raise FileNotFoundError(f"experiment file {path!r} not found (looked in {candidates})")


def load_experiment(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """`path` may carry the arg after a colon: experiments/pretrain.py:tiny."""
  if arg is None and ":" in path:
    path, arg = path.rsplit(":", 1)
  return load_module(path).get_config(arg)


# ------------------------------------------------------------------------- command lines
# `python -m c2.main` and `python -m c2.aot` define their flags through `define_config_flag`,
# and `parse_command` runs exactly that parser on an argv (the launch tests feed it every command
# the launch scripts print), so a command that parses here parses on the pod.


def define_config_flag(flag_values, argv: Optional[list[str]] = None, *,
                       lock_config: bool = True):
  """--config experiments/<phase>.py:<arg>, with --config.a.b=v overrides (ml_collections reads
  which overrides exist from `argv` when the flag is defined; None: sys.argv)."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  return config_flags.DEFINE_config_file("config", None, "experiment file[:variant]",
                                         flag_values=flag_values, lock_config=lock_config,
                                         sys_argv=argv)


def parse_command(argv: list[str], define_flags) -> tuple[Any, Any]:
  """Parses argv (argv[0] is the program) with the flags `define_flags(flag_values, argv)`
  declares on a fresh FlagValues; returns (ExperimentConfig, flag_values). Raises absl's flags.Error on
  an unknown flag or override key, c2.config.ConfigError on a bad config."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from c2 import config as config_lib  # pylint: disable=import-outside-toplevel
  flag_values = flags.FlagValues()
  define_flags(flag_values, list(argv))
  flag_values(list(argv))
  if flag_values["config"].value is None:
    raise flags.Error("--config experiments/<phase>.py:<variant> is required")
  return config_lib.from_config_dict(flag_values["config"].value), flag_values
