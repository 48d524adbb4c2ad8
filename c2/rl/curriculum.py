"""Which unused task the coordinator starts next: in order, or upsampled by signals of its kind.

Late in Composer 2's run the data mix was shifted toward harder tasks, with difficulty read from
the policy's own behaviour on them: more turns and more thinking tokens (composer2_report.md 4).
Every task is still used once (each prompt once, as the step requires), so the curriculum cannot
repeat a hard task; it instead learns which *kinds* of task are hard from finished groups and
draws the next task from a window of unused ones with weights by its kind's score.

    curriculum = Curriculum(start_group=200, window=64, weights={"turns": 1.0,
                            "thinking_tokens": 0.5, "failure": 1.0})
    task_id = curriculum.choose(unused_ids, unused_tasks, rng_seed)   # coordinator
    curriculum.record(task, rollouts)                                  # after each group

Signals, per finished group: `turns` and `thinking_tokens` (means over its rollouts), `failure`
(the fraction that failed) and `informative` (1 when its rewards differ, so its advantages are
not all zero, else 0). Weighting `informative` upsamples the kinds whose groups teach something
(learnability sampling): where a hard kind's groups mostly fail alike, they are dropped
(`rl.drop_uniform_groups`) after costing their rollouts, and drawing the kinds that split makes
each trained group cheaper. On the tiny level-1 tasks the two kinds split about equally often,
so it saved nothing there (README, "Agentic RL").

A task's kind is its `kind:` tag and level (c2/envs/task_generator.py sets both); the score of a
kind is the weighted sum of its groups' mean signals, each divided by its mean over all kinds, so
the weights are unit-free. Before `start_group` groups have finished, tasks go in order. The
window must be wide against the run's groups: choosing one kind drains it from the window, which
refills in task order, so a narrow window drifts back to the task order's mix.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Optional, Sequence

import numpy as np

from c2.envs.tasks import Task

SIGNALS = ("turns", "thinking_tokens", "failure", "informative")


def parse_weights(text: str) -> dict[str, float]:
  """'turns=1,informative=2' -> {'turns': 1.0, 'informative': 2.0} (rl.curriculum_weights)."""
  weights = {}
  for item in filter(None, (part.strip() for part in text.split(","))):
    name, _, value = item.partition("=")
    try:
      weight = float(value)
    except ValueError:
      weight = -1.0
    if not (np.isfinite(weight) and weight >= 0):
      raise ValueError(f"curriculum weights {text!r}: {item!r} is not SIGNAL=WEIGHT with a weight "
                       f">= 0; signals: {', '.join(SIGNALS)}")
    weights[name.strip()] = weight
  unknown = set(weights) - set(SIGNALS)
  if unknown:
    raise ValueError(f"curriculum weights {text!r}: unknown signals {sorted(unknown)}; known "
                     f"{SIGNALS}")
  return weights


def task_kind(task: Task) -> str:
  kind = next((t.split(":", 1)[1] for t in task.tags if t.startswith("kind:")), "task")
  return f"{kind}/l{task.level}"


@dataclasses.dataclass
class Curriculum:
  start_group: Optional[int] = None  # None: never reweight (tasks in order)
  window: int = 64  # unused tasks considered per choice
  weights: Mapping[str, float] = dataclasses.field(
      default_factory=lambda: {"turns": 1.0, "thinking_tokens": 1.0, "failure": 0.0})
  temperature: float = 1.0  # sharpness of the upsampling: weight = max(score, floor) ** (1 / T)
  # The least score a kind is drawn with: with `informative` weighted, a kind that has not split
  # a group yet scores 0 and, without a floor, would never be drawn again to show it improved.
  floor: float = 1e-6

  def __post_init__(self):
    unknown = set(self.weights) - set(SIGNALS)
    if unknown:
      raise ValueError(f"curriculum weights: unknown signals {sorted(unknown)}; known {SIGNALS}")
    if not self.floor > 0:
      raise ValueError(f"curriculum floor must be > 0, got {self.floor}")
    self._sums: dict = collections.defaultdict(lambda: np.zeros(len(SIGNALS) + 1))
    self.groups_recorded = 0

  def record(self, task: Task, rollouts: Sequence) -> None:
    """Adds a finished group's mean signals to its kind's totals."""
    signals = np.array([
        np.mean([r.stats.get("turns", 0) for r in rollouts]),
        np.mean([r.stats.get("thinking_tokens", 0) for r in rollouts]),
        np.mean([0.0 if r.passed else 1.0 for r in rollouts]),
        float(np.ptp([r.reward for r in rollouts]) > 0), 1.0])
    self._sums[task_kind(task)] += signals
    self.groups_recorded += 1

  def difficulty(self) -> dict[str, float]:
    """Kind -> unit-free score (1.0 = average), from the groups recorded so far."""
    if not self._sums:
      return {}
    means = {kind: s[:-1] / s[-1] for kind, s in self._sums.items()}
    overall = np.mean(list(means.values()), axis=0)
    scale = np.where(overall > 0, overall, 1.0)
    w = np.array([self.weights.get(name, 0.0) for name in SIGNALS])
    total = max(w.sum(), 1e-9)
    return {kind: float(np.dot(w, m / scale) / total) for kind, m in means.items()}

  def choose(self, unused_ids: Sequence[str], unused_tasks: Sequence[Task], rng_seed: int) -> str:
    if (self.start_group is None or self.groups_recorded < self.start_group
        or not self._sums):
      return unused_ids[0]
    difficulty = self.difficulty()
    candidates = list(range(min(self.window, len(unused_ids))))
    # Kinds never seen get the average score (1.0), so new kinds are not starved.
    scores = np.array([difficulty.get(task_kind(unused_tasks[i]), 1.0) for i in candidates])
    weights = np.maximum(scores, self.floor) ** (1.0 / self.temperature)
    rng = np.random.default_rng(rng_seed)
    return unused_ids[int(rng.choice(candidates, p=weights / weights.sum()))]

  def state_dict(self) -> dict:
    return {"groups_recorded": self.groups_recorded,
            "sums": {kind: s.tolist() for kind, s in self._sums.items()}}

  def load_state_dict(self, state: dict) -> None:
    self.groups_recorded = state.get("groups_recorded", 0)
    for kind, values in state.get("sums", {}).items():
      values = np.array(values, np.float64)
      # A state saved before a signal was added lacks its column (before the count): zeros,
      # so that signal's means count only the groups recorded since.
      missing = len(SIGNALS) + 1 - len(values)
      self._sums[kind] = np.insert(values, len(values) - 1, np.zeros(missing))
