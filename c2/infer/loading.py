"""Finds a model to serve in a directory: (ModelConfig, host params, Tokenizer).

Three layouts are recognised, checked in this order:
  converted   `python -m c2.hf.convert import`: params/ (orbax) + model_config.json
  workdir     a c2 training run: tb/config.json (the experiment, written by c2/train/metrics.py)
              + ckpt/<step>/params (orbax, c2/train/checkpoint.py); the latest step is served
  hugging face  config.json + *.safetensors (DeepseekV3 / Kimi), via c2.hf.checkpoint
The tokenizer is `tokenizer.json` or `tiktoken.model` in the directory (for a workdir, the
experiment's `data.tokenizer`, whose "default" is the workdir's cached tokenizer.json).

Params are restored onto the host CPU (numpy-backed arrays); the engine places them. Only the
params of a training checkpoint are read, never the optimizer state.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from c2 import model
from c2.data.tokenizer import Tokenizer, load_tokenizer
from c2.hf import checkpoint as hf_checkpoint
from c2.hf import config as hf_config
from c2.hf.convert import CONFIG_FILE, PARAMS_DIR
from c2.hf.tensors import CheckpointError
from c2.model.config import ModelConfig
from c2.parallel.sharding import with_shardings

DTYPES = ("float32", "bfloat16")
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")


class LoadError(ValueError):
  """The directory is not a servable checkpoint; the message names the path and what was expected."""


def load_for_serving(path: str, dtype: Optional[str] = None, step: Optional[int] = None
                     ) -> tuple[ModelConfig, dict, Tokenizer]:
  """Returns (cfg, params on the host, tokenizer). `dtype` overrides the compute dtype
  (cfg.dtype), e.g. "float32" for reference numerics; None keeps the checkpoint's. `step` picks
  a training workdir's checkpoint (None: the latest)."""
  if dtype is not None and dtype not in DTYPES:
    raise LoadError(f"dtype must be one of {DTYPES} or None, got {dtype!r}")
  if not os.path.isdir(path):
    raise LoadError(f"{path}: no such directory; expected a c2 workdir, a converted checkpoint "
                    f"({PARAMS_DIR}/ + {CONFIG_FILE}) or a Hugging Face checkpoint directory")
  if os.path.exists(os.path.join(path, CONFIG_FILE)):
    cfg, params, tokenizer = _load_converted(path)
  elif os.path.exists(os.path.join(path, "tb", "config.json")):
    cfg, params, tokenizer = _load_workdir(path, step)
  elif os.path.exists(os.path.join(path, "config.json")):
    cfg, params, tokenizer = _load_hugging_face(path, dtype)
  else:
    raise LoadError(f"{path}: found none of {CONFIG_FILE} (converted checkpoint), tb/config.json "
                    "(c2 training workdir) or config.json (Hugging Face checkpoint)")
  if dtype is not None:
    cfg = cfg.replace(dtype=dtype)
  if tokenizer.vocab_size > cfg.vocab_size:
    raise LoadError(f"{path}: the tokenizer has {tokenizer.vocab_size} ids but the model's "
                    f"vocabulary is {cfg.vocab_size}: wrong tokenizer for this checkpoint")
  return cfg, params, tokenizer


def _restore_params(cfg: ModelConfig, params_dir: str) -> dict:
  """The orbax params at `params_dir`, restored into single-device host (CPU) arrays."""
  abstract = model.abstract_params(cfg)
  on_host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
  target = with_shardings(abstract, jax.tree.map(lambda _: on_host, abstract))
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(os.path.abspath(params_dir), target)


def _directory_tokenizer(path: str) -> Tokenizer:
  for name in TOKENIZER_FILES:
    if os.path.exists(os.path.join(path, name)):
      return load_tokenizer(os.path.join(path, name))
  raise LoadError(f"{path}: no tokenizer; expected one of {TOKENIZER_FILES} beside the weights")


def _load_converted(path: str) -> tuple[ModelConfig, dict, Tokenizer]:
  params_dir = os.path.join(path, PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise LoadError(f"{path}: has {CONFIG_FILE} but no {PARAMS_DIR}/ directory (orbax params)")
  with open(os.path.join(path, CONFIG_FILE)) as f:
    cfg = hf_config.from_json(f.read())
  tokenizer = _directory_tokenizer(path)
  return cfg, _restore_params(cfg, params_dir), tokenizer


def workdir_model_config(experiment: dict, source: str) -> ModelConfig:
  """ModelConfig from the experiment dict in tb/config.json (`dataclasses.asdict` of the
  ExperimentConfig, so `model` holds every ModelConfig field, resolved from the preset)."""
  if not isinstance(experiment.get("model"), dict):
    raise LoadError(f"{source}: no 'model' section; expected the experiment config of a c2 run")
  try:
    return hf_config.from_json(json.dumps(experiment["model"]))
  except (TypeError, ValueError) as e:
    raise LoadError(f"{source}: the model section is not a ModelConfig: {e}") from None


def latest_step_dir(ckpt_dir: str) -> str:
  """ckpt/<step> with the largest step among complete checkpoints (orbax renames a step's
  temporary directory to its bare number only once it is fully written)."""
  steps = [int(n) for n in os.listdir(ckpt_dir) if re.fullmatch(r"\d+", n)] \
      if os.path.isdir(ckpt_dir) else []
  if not steps:
    raise LoadError(f"{ckpt_dir}: no checkpoint steps; expected ckpt/<step>/params from training")
  return os.path.join(ckpt_dir, str(max(steps)))


def _load_workdir(path: str, step: Optional[int] = None
                  ) -> tuple[ModelConfig, dict, Tokenizer]:
  config_path = os.path.join(path, "tb", "config.json")
  with open(config_path) as f:
    experiment = json.load(f)
  cfg = workdir_model_config(experiment, config_path)
  ckpt_dir = os.path.join(path, "ckpt")
  step_dir = latest_step_dir(ckpt_dir) if step is None else os.path.join(ckpt_dir, str(step))
  if not os.path.isdir(step_dir):
    raise LoadError(f"{path}: no checkpoint at step {step} in {ckpt_dir}")
  params_dir = os.path.join(step_dir, "params")
  spec = (experiment.get("data") or {}).get("tokenizer", "default")
  if spec == "default":
    # The run trained and cached it in the workdir; serving must not train a different one.
    spec = os.path.join(path, "tokenizer.json")
    if not os.path.exists(spec):
      raise LoadError(f"{path}: the run used the default tokenizer but {spec} is missing")
  return cfg, _restore_params(cfg, params_dir), load_tokenizer(spec)


def _load_hugging_face(path: str, dtype: Optional[str]) -> tuple[ModelConfig, dict, Tokenizer]:
  with open(os.path.join(path, "config.json")) as f:
    declared = hf_config.declared_compute_dtype(json.load(f))
  # Weights stay in the checkpoint's precision: float32 only when asked for or stored so.
  weights = np.float32 if "float32" in (dtype, declared) else ml_dtypes.bfloat16
  tokenizer = _directory_tokenizer(path)
  try:
    cfg, params = hf_checkpoint.import_checkpoint(path, dtype=weights, compute_dtype=dtype)
  except (CheckpointError, KeyError, ValueError) as e:
    raise LoadError(f"{path}: not a loadable Hugging Face DeepseekV3/Kimi checkpoint: {e}") from e
  return cfg, params, tokenizer
