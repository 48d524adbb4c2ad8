"""Figures of evaluation results across checkpoints: PNG + SVG + the JSON of the data behind each.

    paths, images = draw_all(results, out_dir)   # results: {checkpoint label: {metric: value}}

  pareto          inference cost per task (median analytic FLOPs) against pass@1, one point per
                  checkpoint, the Pareto frontier drawn through the undominated ones (the report's
                  Fig. 11 is this plot across models)
  pass_at_k       pass@k against k per checkpoint (best-of-K, report section 4.10)
  context_length  needle / variable-tracking accuracy and answer nats by context length, and NLL
                  by position bucket (the long-context phase's curves)
  base_probes     the base-model probes per checkpoint: codebase nats per byte, state-tracking
                  character distance and file nats per byte, knowledge answer nats per byte and
                  exact match (report Table 2)
A figure whose metrics no checkpoint has is skipped. `images` are RGB arrays for TensorBoard.
"""
from __future__ import annotations

import collections

import json
import os
import re
from typing import Mapping

import numpy as np

Results = Mapping[str, Mapping[str, float]]


def _pyplot():
  """matplotlib's pyplot on the Agg backend (files only; training hosts have no display).
  Imported on first use: it is the `evals` extra, and only figures need it."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError('evaluation figures need matplotlib: pip install -e ".[evals]"') from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def _series(results: Results, pattern: str) -> dict[str, list[tuple[float, float]]]:
  """{label: [(x, value)]} of the metrics matching `pattern`, whose group 1 is the x value."""
  out = {}
  for label, metrics in results.items():
    points = sorted((float(m.group(1)), v) for k, v in metrics.items()
                    if (m := re.fullmatch(pattern, k)))
    if points:
      out[label] = points
  return out


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """The (cost, accuracy) points no other point beats on both (cheaper-or-equal and better),
  sorted by cost."""
  front, best = [], -np.inf
  for cost, acc in sorted(points, key=lambda p: (p[0], -p[1])):
    if acc > best:
      front.append((cost, acc))
      best = acc
  return front


def _pareto(results: Results, ax) -> dict:
  points = {label: (m["eval/agentic/flops_per_task_median"], m["eval/agentic/pass_at_1"])
            for label, m in results.items()
            if "eval/agentic/flops_per_task_median" in m and "eval/agentic/pass_at_1" in m}
  if not points:
    return {}
  colors = _colors(results)
  # Checkpoints that land on the same point (e.g. all at pass@1 = 0 with the same cost) share
  # one label, "a, b": separate labels would be printed over each other, unreadable.
  same_point = collections.defaultdict(list)
  for label, (cost, acc) in points.items():
    ax.scatter(cost, acc, s=40, color=colors[label])
    same_point[(float(f"{cost:.3g}"), round(acc, 3))].append(label)
  for labels in same_point.values():
    ax.annotate(", ".join(labels), points[labels[0]], textcoords="offset points", xytext=(4, 4),
                fontsize=8)
  front = pareto_front(list(points.values()))
  # A staircase: from each frontier point, its accuracy holds until a cheaper-to-beat point.
  right = max(c for c, _ in points.values())
  ax.step([c for c, _ in front] + [right], [a for _, a in front] + [front[-1][1]], "k--",
          where="post", lw=1, label="Pareto frontier")
  ax.set(xscale="log", xlabel="inference cost per task (median analytic FLOPs)",
         ylabel="pass@1 on held-out tasks", title="Cost vs accuracy")
  ax.set_ylim(-0.02, max(1.0, max(a for _, a in points.values())) + 0.02)
  ax.legend(fontsize=8)
  return {"points": {k: {"flops_per_task_median": c, "pass_at_1": a} for k, (c, a) in points.items()},
          "frontier": front}


def _pass_at_k(results: Results, ax) -> dict:
  series = _series(results, r"eval/agentic/pass_at_(\d+)")
  colors = _colors(results)
  for label, points in series.items():
    ax.plot(*zip(*points), marker="o", color=colors[label], label=label)
  if series:
    ax.set(xlabel="k (samples per task)", ylabel="pass@k (unbiased)", title="pass@k, held out")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
  return series


def _colors(results: Results) -> dict[str, str]:
  """One colour per checkpoint, the same in every panel."""
  return {label: f"C{i % 10}" for i, label in enumerate(results)}


def _context_length(results: Results, axes) -> dict:
  data, colors = {}, _colors(results)
  for kind, style in (("needle", "-"), ("variables", ":")):
    for name, ax in (("accuracy", axes[0]), ("answer_nats", axes[1])):
      series = _series(results, rf"eval/long_context/{kind}/{name}_len(\d+)")
      for label, points in series.items():
        ax.plot(*zip(*points), style, marker="o", color=colors[label],
                label=label if kind == "needle" else None)
      data.update({f"{kind}/{name}/{k}": v for k, v in series.items()})
  positions = _series(results, r"eval/long_context/nll_pos(\d+)")
  for label, points in positions.items():
    axes[2].plot(*zip(*points), marker=".", color=colors[label], label=label)
  data.update({f"nll_by_position/{k}": v for k, v in positions.items()})
  axes[0].set(xscale="log", xlabel="context length (tokens)", ylabel="exact match",
              title="Retrieval accuracy by length (solid: needle, dotted: variables)")
  axes[0].set_ylim(-0.02, 1.02)
  axes[1].set(xscale="log", xlabel="context length (tokens)", ylabel="nats of the answer",
              title="Answer nats by length (lower is better)")
  for ax in axes[:2]:
    ax.title.set_fontsize(10)
  axes[2].set(xscale="log", xlabel="position (bucket start)", ylabel="NLL (nats/token)",
              title="Loss by position")
  for ax in axes:
    if ax.has_data():
      ax.legend(fontsize=7)
  return data


_PROBES = (("eval/codebase/nats_per_byte", "codebase nats per byte (lower is better)"),
           ("eval/state_tracking/char_distance", "state tracking: char distance (lower)"),
           ("eval/state_tracking/target_nats_per_byte", "state tracking: file nats/byte (lower)"),
           ("eval/knowledge/answer_nats_per_byte", "knowledge: answer nats/byte (lower)"),
           ("eval/knowledge/exact_match", "knowledge: exact match (higher)"))


def _base_probes(results: Results, axes) -> dict:
  data = {}
  labels = list(results)
  for (key, title), ax in zip(_PROBES, axes):
    values = [results[label].get(key, np.nan) for label in labels]
    if np.all(np.isnan(values)):
      ax.set_visible(False)
      continue
    ax.bar(range(len(labels)), values, color=[_colors(results)[l] for l in labels])
    for i, v in enumerate(values):
      ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    ax.set_title(title, fontsize=9)
    if key.endswith("exact_match"):
      ax.set_ylim(0, 1.05)
    data[key] = dict(zip(labels, values))
    baseline = [results[l].get("eval/state_tracking/copy_baseline_distance") for l in labels]
    if key.endswith("char_distance") and all(b is not None for b in baseline):
      # Copying the original file unchanged scores this: below it, the model tracks the diffs.
      ax.axhline(np.mean(baseline), color="k", ls="--", lw=1, label="copy the original")
      ax.legend(fontsize=7)
      data["eval/state_tracking/copy_baseline_distance"] = dict(zip(labels, baseline))
  return data


def _save(fig, name: str, data: dict, out_dir: str) -> str:
  fig.tight_layout()
  png = os.path.join(out_dir, f"{name}.png")
  fig.savefig(png, dpi=110)
  fig.savefig(os.path.join(out_dir, f"{name}.svg"))
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(data, f, indent=1, default=float)
  return png


def _rgb(fig) -> np.ndarray:
  fig.canvas.draw()
  return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()  # [H, W, 3] uint8


def draw_all(results: Results, out_dir: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
  """Writes every figure that has data to out_dir/<name>.{png,svg,json}; returns ({name: png
  path}, {name: RGB image [H, W, 3] uint8})."""
  os.makedirs(out_dir, exist_ok=True)
  plt = _pyplot()
  figures = (("pareto", (1, 1), (6, 4.5), _pareto), ("pass_at_k", (1, 1), (6, 4.5), _pass_at_k),
             ("context_length", (1, 3), (16, 4.5), _context_length),
             ("base_probes", (1, 5), (20, 4), _base_probes))
  paths, images = {}, {}
  for name, grid, size, draw in figures:
    fig, axes = plt.subplots(*grid, figsize=size, squeeze=False)
    axes = axes[0] if grid[1] > 1 else axes[0, 0]
    data = draw(results, axes)
    if data:
      paths[name] = _save(fig, name, data, out_dir)
      images[name] = _rgb(fig)
    plt.close(fig)
  return paths, images
