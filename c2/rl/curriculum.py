"""Which unused task the coordinator starts next: in order, or upsampled by difficulty signals.

Late in Composer 2's run the data mix was shifted toward harder tasks, with difficulty read from
the policy's own behaviour on them: more turns and more thinking tokens (composer2_report.md 4).
Every task is still used once (each prompt once, as the step requires), so the curriculum cannot
repeat a hard task; it instead learns which *kinds* of task are hard from finished groups and
draws the next task from a window of unused ones with weights by its kind's difficulty.

    curriculum = Curriculum(start_group=200, window=64, weights={"turns": 1.0,
                            "thinking_tokens": 0.5, "failure": 1.0})
    task_id = curriculum.choose(unused_ids, unused_tasks, rng_seed)   # coordinator
    curriculum.record(task, rollouts)                                  # after each group

A task's kind is its `kind:` tag and level (c2/envs/task_generator.py sets both); difficulty of a
kind is the weighted sum of its groups' mean signals, each divided by its mean over all kinds, so
the weights are unit-free. Before `start_group` groups have finished, tasks go in order.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Optional, Sequence

import numpy as np

from c2.envs.tasks import Task

SIGNALS = ("turns", "thinking_tokens", "failure")


def task_kind(task: Task) -> str:
  kind = next((t.split(":", 1)[1] for t in task.tags if t.startswith("kind:")), "task")
  return f"{kind}/l{task.level}"


@dataclasses.dataclass
class Curriculum:
  start_group: Optional[int] = None  # None: never reweight (tasks in order)
  window: int = 64  # unused tasks considered per choice
  weights: Mapping[str, float] = dataclasses.field(
      default_factory=lambda: {"turns": 1.0, "thinking_tokens": 1.0, "failure": 0.0})
  temperature: float = 1.0  # sharpness of the upsampling: weight = difficulty ** (1 / T)

  def __post_init__(self):
    unknown = set(self.weights) - set(SIGNALS)
    if unknown:
      raise ValueError(f"curriculum weights: unknown signals {sorted(unknown)}; known {SIGNALS}")
    self._sums: dict = collections.defaultdict(lambda: np.zeros(len(SIGNALS) + 1))
    self.groups_recorded = 0

  def record(self, task: Task, rollouts: Sequence) -> None:
    """Adds a finished group's mean signals to its kind's totals."""
    signals = np.array([
        np.mean([r.stats.get("turns", 0) for r in rollouts]),
        np.mean([r.stats.get("thinking_tokens", 0) for r in rollouts]),
        np.mean([0.0 if r.passed else 1.0 for r in rollouts]), 1.0])
    self._sums[task_kind(task)] += signals
    self.groups_recorded += 1

  def difficulty(self) -> dict[str, float]:
    """Kind -> unit-free difficulty (1.0 = average), from the groups recorded so far."""
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
    # Kinds never seen get the average difficulty (1.0), so new kinds are not starved.
    scores = np.array([difficulty.get(task_kind(unused_tasks[i]), 1.0) for i in candidates])
    weights = np.maximum(scores, 1e-6) ** (1.0 / self.temperature)
    rng = np.random.default_rng(rng_seed)
    return unused_ids[int(rng.choice(candidates, p=weights / weights.sum()))]

  def state_dict(self) -> dict:
    return {"groups_recorded": self.groups_recorded,
            "sums": {kind: s.tolist() for kind, s in self._sums.items()}}

  def load_state_dict(self, state: dict) -> None:
    self.groups_recorded = state.get("groups_recorded", 0)
    for kind, values in state.get("sums", {}).items():
      self._sums[kind] = np.array(values)
