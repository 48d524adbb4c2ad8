"""One metrics writer: TensorBoard event files (workdir/tb) plus a JSONL mirror, process 0 only.

Scalars use hierarchical names (train/loss, eval/loss, mtp/1/kl, moe/load_max_over_mean, ...);
images (evaluation figures) go to TensorBoard only.
The experiment config is written beside the curves as text and as TensorBoard hparams, so a run's
curves always travel with the settings that produced them.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Mapping

import jax
import numpy as np


def flatten_config(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Nested dicts/dataclass-dicts -> {"a.b": scalar}; non-scalars become strings."""
  out = {}
  if isinstance(tree, Mapping):
    for key, value in tree.items():
      out.update(flatten_config(value, f"{prefix}{key}."))
  else:
    key = prefix[:-1]
    out[key] = tree if isinstance(tree, (int, float, str, bool)) else str(tree)
  return out


class MetricWriter:
  def __init__(self, logdir: str, *, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.logdir = logdir
    self._tb = None
    self._jsonl = None
    if self.enabled:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      os.makedirs(logdir, exist_ok=True)
      self._tb = SummaryWriter(logdir, flush_secs=10)
      self._jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> list[str]:
    """Writes every scalar, finite or not, and returns the names of the non-finite ones.

    A NaN or inf is a finding, never dropped: TensorBoard gets the value as it is, the JSONL
    mirror gets "nan" / "inf" / "-inf" (strict JSON has no NaN), and a warning names each one.
    """
    if not self.enabled:
      return []
    values = {k: float(np.asarray(v)) for k, v in scalars.items()}
    for key, value in values.items():
      self._tb.add_scalar(key, value, global_step=step)
    nonfinite = sorted(k for k, v in values.items() if not math.isfinite(v))
    record = {k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}
    self._jsonl.write(json.dumps({"step": step, **record}) + "\n")
    self._jsonl.flush()
    if nonfinite:
      logging.warning("step %d: non-finite metrics %s", step,
                      ", ".join(f"{k}={values[k]}" for k in nonfinite))
    return nonfinite

  def write_images(self, step: int, images: Mapping[str, Any]) -> None:
    """RGB images [H, W, 3] uint8 (e.g. evaluation figures, c2/evals/plots.py) by name."""
    if not self.enabled:
      return
    for key, image in images.items():
      self._tb.add_image(key, np.asarray(image), global_step=step, dataformats="HWC")
    self._tb.flush()

  def write_config(self, config_dict: Mapping[str, Any], headline: Mapping[str, float]) -> None:
    """Config as text plus TensorBoard hparams (flattened config, with headline metrics)."""
    if not self.enabled:
      return
    self._tb.add_text("config", "```\n" + json.dumps(config_dict, indent=2, default=str) + "\n```")
    self._tb.add_hparams(flatten_config(config_dict), dict(headline), name="hparams")
    with open(os.path.join(self.logdir, "config.json"), "w") as f:
      json.dump(config_dict, f, indent=2, default=str)

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()
