"""Where evaluation results go: a results JSON across checkpoints, a table, figures, TensorBoard.

    results = record(out_dir, "step 240", 240, scalars)      # out_dir/results.json, merged
    print(format_table(results))
    paths = publish(out_dir, results, writer, step=240)        # out_dir/plots/*.png|svg|json + TB

`results.json` keeps every checkpoint evaluated into the directory ({label: {"step", "metrics"}}),
so figures across checkpoints (the cost/accuracy Pareto plot, pass@k curves) grow one command or
one training evaluation at a time. `evaluate_in_training` is the train loop's hook.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
from typing import Callable, Mapping, Optional, Sequence

import jax

from c2.evals import plots
from c2.evals.suites import SuiteOptions, run_suites

RESULTS_FILE = "results.json"


def load(out_dir: str) -> dict:
  path = os.path.join(out_dir, RESULTS_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def record(out_dir: str, label: str, step: Optional[int], scalars: Mapping[str, float]) -> dict:
  """Merges one checkpoint's scalars into out_dir/results.json (atomically; an earlier entry
  with the same label gets the new metrics added over its own). Returns {label: metrics},
  ordered by step (unknown steps last)."""
  os.makedirs(out_dir, exist_ok=True)
  stored = load(out_dir)
  entry = stored.get(label, {"step": step, "metrics": {}})
  entry["step"] = step
  entry["metrics"] = {**entry["metrics"], **{k: float(v) for k, v in scalars.items()}}
  stored[label] = entry
  path = os.path.join(out_dir, RESULTS_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump(stored, f, indent=1)
  os.replace(path + ".tmp", path)
  return by_label(stored)


def by_label(stored: Mapping) -> dict[str, dict[str, float]]:
  order = sorted(stored, key=lambda k: (stored[k]["step"] is None, stored[k]["step"] or 0, k))
  return {label: stored[label]["metrics"] for label in order}


def natural_sorted(keys) -> list[str]:
  """Numbers inside names sort by value: nll_pos2 before nll_pos16, pass_at_2 before pass_at_10."""
  return sorted(keys, key=lambda k: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                     for p in re.split(r"(\d+)", k)])


def format_table(results: Mapping[str, Mapping[str, float]],
                 names: Optional[Sequence[str]] = None) -> str:
  """Metrics as rows, checkpoints as columns (4 significant digits)."""
  labels = list(results)
  keys = list(names) if names is not None else natural_sorted({k for m in results.values()
                                                                for k in m})
  width = max([len(k) for k in keys] + [6])
  cols = [max(len(l), 10) for l in labels]
  lines = [" " * width + "  " + "  ".join(l.rjust(c) for l, c in zip(labels, cols))]
  for key in keys:
    cells = [f"{results[l][key]:.4g}" if key in results[l] else "-" for l in labels]
    lines.append(key.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(cells, cols)))
  return "\n".join(lines)


def publish(out_dir: str, results: Mapping[str, Mapping[str, float]], writer=None,
            step: int = 0) -> dict[str, str]:
  """Figures to out_dir/plots (PNG, SVG, JSON) and, with a MetricWriter, as TensorBoard images
  named eval/plots/<figure>. Returns {figure: png path}."""
  paths, images = plots.draw_all(results, os.path.join(out_dir, "plots"))
  if writer is not None and images:
    writer.write_images(step, {f"eval/plots/{name}": image for name, image in images.items()})
  return paths


def evaluate_in_training(names: Sequence[str], cfg, params, tokenizer, options: SuiteOptions, *,
                         step: int, out_dir: str, writer,
                         log: Callable[[str], None] = print) -> dict[str, float]:
  """The train loop's hook: the suites on this step's params (the pinned version is the step
  they are logged at), scalars and figures to the run's writer, results to out_dir.

  Runs on a thread of its own: the trainer's mesh and transfer guard are thread-local, and the
  probes are a separate single-device program (params copied to the host first, explicitly)."""
  def work() -> dict[str, float]:
    host_params = jax.device_get(params)
    scalars = run_suites(names, cfg, host_params, tokenizer, options, log=log)
    results = record(out_dir, f"step {step}", step, scalars)
    writer.write_scalars(step, scalars)
    paths = publish(out_dir, results, writer, step)
    log(f"step {step}: eval suites {', '.join(names)}; figures in "
        f"{os.path.join(out_dir, 'plots')} ({', '.join(sorted(paths))})")
    return scalars

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(work).result()
