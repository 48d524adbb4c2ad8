"""Figures: files exist (PNG, SVG, JSON of the data), the Pareto frontier, skipped empty figures."""
import json
import os

import numpy as np

from c2.evals import plots


def test_pareto_front():
  points = [(1.0, 0.2), (2.0, 0.1), (2.0, 0.5), (3.0, 0.5), (5.0, 0.9), (0.5, 0.0)]
  assert plots.pareto_front(points) == [(0.5, 0.0), (1.0, 0.2), (2.0, 0.5), (5.0, 0.9)]


def _results():
  out = {}
  for i, label in enumerate(["step 60", "step 240"]):
    m = {"eval/agentic/flops_per_task_median": 1e9 * (i + 1), "eval/agentic/pass_at_1": 0.1 * i,
         "eval/codebase/nats_per_byte": 2.0 - 0.5 * i, "eval/state_tracking/char_distance": 90.0}
    m.update({f"eval/agentic/pass_at_{k}": min(1.0, 0.1 * i * k) for k in (1, 2, 3, 4)})
    m.update({f"eval/long_context/needle/accuracy_len{n}": 0.5 * i for n in (64, 128)})
    m.update({f"eval/long_context/nll_pos{p}": 5.0 - i - 0.1 * np.log2(p) for p in (1, 2, 4, 8)})
    out[label] = m
  return out


def test_draw_all_writes_every_figure_with_its_data(tmp_path):
  paths, images = plots.draw_all(_results(), str(tmp_path))
  assert set(paths) == {"pareto", "pass_at_k", "context_length", "base_probes"}
  for name in paths:
    for ext in ("png", "svg"):
      assert os.path.getsize(tmp_path / f"{name}.{ext}") > 5000
    assert json.loads((tmp_path / f"{name}.json").read_text())
    assert images[name].ndim == 3 and images[name].shape[2] == 3 and images[name].dtype == np.uint8
  data = json.loads((tmp_path / "pass_at_k.json").read_text())
  assert data["step 240"] == [[1, 0.1], [2, 0.2], [3, 0.30000000000000004], [4, 0.4]]
  pareto = json.loads((tmp_path / "pareto.json").read_text())
  assert pareto["points"]["step 240"] == {"flops_per_task_median": 2e9, "pass_at_1": 0.1}
  probes = json.loads((tmp_path / "base_probes.json").read_text())
  assert probes["eval/codebase/nats_per_byte"] == {"step 60": 2.0, "step 240": 1.5}


def test_figures_without_data_are_skipped(tmp_path):
  paths, _ = plots.draw_all({"a": {"eval/codebase/nats_per_byte": 1.0}}, str(tmp_path))
  assert set(paths) == {"base_probes"}
  assert not (tmp_path / "pareto.png").exists()


def test_checkpoints_on_the_same_point_share_one_label():
  plt = plots._pyplot()
  fig, ax = plt.subplots()
  same = {"eval/agentic/flops_per_task_median": 2.6e9, "eval/agentic/pass_at_1": 0.0}
  results = {"tiny@180": dict(same), "tiny@240": dict(same),
             "tiny@300": {"eval/agentic/flops_per_task_median": 5e9, "eval/agentic/pass_at_1": 0.5}}
  plots._pareto(results, ax)
  assert sorted(t.get_text() for t in ax.texts) == ["tiny@180, tiny@240", "tiny@300"]
  plt.close(fig)
