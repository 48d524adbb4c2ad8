"""Held-out pass-rate statistics: the interval over tasks and the paired change between evals."""
import math

import numpy as np
import pytest

from c2.envs.tasks import Task
from c2.rl import metrics


def test_pass_rate_interval_is_over_tasks_and_clipped():
  # Per-task rates 1, 0.5, 0.5, 0 -> mean 0.5, sd sqrt(1/6), over 4 tasks (not 8 rollouts).
  results = [("a", True), ("a", True), ("b", True), ("b", False), ("c", False), ("c", True),
             ("d", False), ("d", False)]
  out = metrics.pass_rate(results)
  half = 1.96 * math.sqrt(1 / 6) / math.sqrt(4)
  assert out["pass_rate"] == pytest.approx(0.5)
  assert out["pass_rate_ci_low"] == pytest.approx(0.5 - half)
  assert out["pass_rate_ci_high"] == pytest.approx(0.5 + half)
  assert (out["tasks"], out["rollouts"]) == (4.0, 8.0)
  # One pass in 20 tasks: the unclipped interval would reach below 0.
  low = metrics.pass_rate([("t0", True)] + [(f"t{i}", False) for i in range(1, 20)])
  assert low["pass_rate"] == pytest.approx(0.05) and low["pass_rate_ci_low"] == 0.0
  assert low["pass_rate_ci_high"] == pytest.approx(0.05 + 1.96 * np.std([1] + [0] * 19, ddof=1)
                                                   / math.sqrt(20))


def test_pass_rate_change_is_paired_over_shared_tasks():
  start = {"a": 0.0, "b": 0.5, "c": 1.0, "gone": 0.0}
  end = {"a": 0.5, "b": 1.0, "c": 1.0, "new": 1.0}
  out = metrics.pass_rate_change(start, end)
  diffs = np.array([0.5, 0.5, 0.0])  # a, b, c; tasks in only one evaluation are left out
  half = 1.96 * diffs.std(ddof=1) / math.sqrt(3)
  assert out["pass_rate_change"] == pytest.approx(diffs.mean())
  assert out["pass_rate_change_ci_low"] == pytest.approx(diffs.mean() - half)
  assert out["pass_rate_change_ci_high"] == pytest.approx(diffs.mean() + half)
  # The same shift on every task is certain: a zero-width interval, unlike two unpaired ones.
  same = metrics.pass_rate_change({"a": 0.0, "b": 0.5}, {"a": 0.25, "b": 0.75})
  assert same["pass_rate_change_ci_low"] == pytest.approx(0.25) == same["pass_rate_change"]
  assert metrics.pass_rate_change({"a": 1.0}, {"b": 1.0}) == {}


def test_pass_rate_by_kind_averages_the_rollouts_of_each_kind_tag():
  kind = lambda *tags: Task("t", "p", tags=tags).kind
  results = [(kind("level:1", "kind:set_constant"), True), (kind("kind:set_constant"), False),
             (kind("kind:set_constant", "level:1"), True), (kind("kind:rename_symbol"), False),
             (kind(), True)]  # an external task without a kind: in no kind's rate
  assert metrics.pass_rate_by_kind(results) == {"pass_rate/rename_symbol": 0.0,
                                                "pass_rate/set_constant": pytest.approx(2 / 3)}
  assert metrics.pass_rate_by_kind([]) == {}
