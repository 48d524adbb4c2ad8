"""Loads an experiment file's `get_config(arg)` by path (as `--config file.py:arg` does).

Used by the AOT tool, the sweep helper and tests, which need a config without absl flags.
"""
from __future__ import annotations

import importlib.util
import os
import sys

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
