"""The curriculum: tasks in order until `start_group` groups have finished, then drawn from a window
with weights by their kind's score (turns, thinking tokens, failures, informative groups, each
relative to the mean over kinds). Values are computed by hand from the recorded signals."""
import json
import types

import numpy as np
import pytest

from c2.envs.tasks import Task
from c2.rl.curriculum import SIGNALS, Curriculum, parse_weights, task_kind

DRAWS = 2000  # choices per frequency check: the binomial standard error is ~0.01


def make_tasks(kinds, n):
  """`n` tasks cycling through `kinds`, all level 1."""
  return [Task(task_id=f"t{i:03d}", prompt=f"task {i}", tags=(f"kind:{kinds[i % len(kinds)]}",),
               level=1) for i in range(n)]


def group(turns, thinking, passed=(True, False), rewards=None):
  """Rollouts as the curriculum reads them: stats, passed and reward (default: 1 if passed)."""
  rewards = [float(p) for p in passed] if rewards is None else rewards
  return [types.SimpleNamespace(stats={"turns": turns, "thinking_tokens": thinking}, passed=p,
                                reward=r) for p, r in zip(passed, rewards)]


def hard_and_easy(curriculum, groups=3):
  """Kind a: 8 turns, 400 thinking tokens; kind b: 2 turns, 100. Relative to the means (5, 250):
  a = (1.6, 1.6), b = (0.4, 0.4)."""
  hard, easy = make_tasks(("a", "b"), 2)
  for _ in range(groups):
    curriculum.record(hard, group(8, 400))
    curriculum.record(easy, group(2, 100))


def share_of(curriculum, tasks, kind, draws=DRAWS):
  ids = [t.task_id for t in tasks]
  by_id = {t.task_id: t for t in tasks}
  chosen = [by_id[curriculum.choose(ids, tasks, rng_seed=seed)] for seed in range(draws)]
  return np.mean([task_kind(t) == kind for t in chosen])


def test_task_kind_is_kind_tag_and_level():
  assert task_kind(Task(task_id="x", prompt="p", tags=("level:3", "kind:rename"), level=3)) == (
      "rename/l3")
  assert task_kind(Task(task_id="y", prompt="p")) == "task/l0"


def test_tasks_go_in_order_before_start_group():
  tasks = make_tasks(("a", "b"), 20)
  ids = [t.task_id for t in tasks]
  curriculum = Curriculum(start_group=6)
  hard_and_easy(curriculum, groups=2)  # 4 groups < 6
  assert {curriculum.choose(ids, tasks, rng_seed=seed) for seed in range(50)} == {ids[0]}
  hard_and_easy(curriculum, groups=1)  # 6 groups: reweighted draws begin
  assert len({curriculum.choose(ids, tasks, rng_seed=seed) for seed in range(50)}) > 1
  never = Curriculum(start_group=None)  # the default: never reweights
  hard_and_easy(never, groups=10)
  assert {never.choose(ids, tasks, rng_seed=seed) for seed in range(50)} == {ids[0]}


def test_difficulty_is_relative_to_the_mean_over_kinds():
  curriculum = Curriculum(start_group=0)
  assert curriculum.difficulty() == {}
  hard_and_easy(curriculum)
  assert curriculum.groups_recorded == 6
  assert curriculum.difficulty() == pytest.approx({"a/l1": 1.6, "b/l1": 0.4})
  # Failure alone: a fails every rollout, b half of them; the means (1.0, 0.5) over 0.75.
  failures = Curriculum(start_group=0, weights={"failure": 1.0})
  hard, easy = make_tasks(("a", "b"), 2)
  failures.record(hard, group(1, 0, passed=(False, False)))
  failures.record(easy, group(1, 0, passed=(True, False)))
  assert failures.difficulty() == pytest.approx({"a/l1": 4 / 3, "b/l1": 2 / 3})


def test_harder_kinds_are_chosen_more_often():
  tasks = make_tasks(("a", "b"), 40)  # a and b alternate: 20 of each in the window
  curriculum = Curriculum(start_group=4, window=64)
  hard_and_easy(curriculum)
  # Weights 1.6 and 0.4 over equal counts: a is chosen 80% of the time (in order: 50%).
  assert share_of(curriculum, tasks, "a/l1") == pytest.approx(0.8, abs=0.04)
  # Temperature 0.5 squares the weights: 2.56 against 0.16, a 94%.
  sharp = Curriculum(start_group=4, window=64, temperature=0.5)
  hard_and_easy(sharp)
  assert share_of(sharp, tasks, "a/l1") == pytest.approx(0.941, abs=0.03)
  # A kind never seen counts as average (1.0): against b's 0.4 it is chosen 1 / 1.4 = 71%.
  unseen = make_tasks(("c", "b"), 40)
  assert share_of(curriculum, unseen, "c/l1") == pytest.approx(1 / 1.4, abs=0.04)


def test_window_limits_the_candidates():
  tasks = make_tasks(("b", "a"), 40)  # an easy task first, then alternating
  ids = [t.task_id for t in tasks]
  curriculum = Curriculum(start_group=0, window=2)
  hard_and_easy(curriculum)
  chosen = {curriculum.choose(ids, tasks, rng_seed=seed) for seed in range(200)}
  assert chosen == set(ids[:2])
  only_first = Curriculum(start_group=0, window=1)
  hard_and_easy(only_first)
  assert {only_first.choose(ids, tasks, rng_seed=seed) for seed in range(50)} == {ids[0]}


def test_unknown_signal_is_refused():
  with pytest.raises(ValueError, match=r"unknown signals \['reward'\]") as error:
    Curriculum(weights={"turns": 1.0, "reward": 1.0})
  assert all(name in str(error.value) for name in SIGNALS)


def test_state_dict_round_trip():
  curriculum = Curriculum(start_group=2, window=16)
  hard_and_easy(curriculum)
  curriculum.record(make_tasks(("c",), 1)[0], group(5, 50, passed=(False, False)))
  state = json.loads(json.dumps(curriculum.state_dict()))  # saved in the JSON checkpoint
  restored = Curriculum(start_group=2, window=16)
  restored.load_state_dict(state)
  assert restored.groups_recorded == curriculum.groups_recorded == 7
  assert restored.difficulty() == curriculum.difficulty()
  tasks = make_tasks(("a", "b", "c"), 30)
  ids = [t.task_id for t in tasks]
  assert ([restored.choose(ids, tasks, rng_seed=s) for s in range(100)] ==
          [curriculum.choose(ids, tasks, rng_seed=s) for s in range(100)])


def test_informative_kinds_are_drawn_more_often():
  """`informative` is 1 for a group whose rewards differ (not whose outcomes differ): kind a splits
  one group of two, by a penalty between two failures; kind b's groups fail alike."""
  curriculum = Curriculum(start_group=0, window=64, weights={"informative": 1.0}, floor=0.1)
  a, b = make_tasks(("a", "b"), 2)
  curriculum.record(a, group(3, 0, passed=(False, False), rewards=[0.0, -0.2]))
  curriculum.record(a, group(3, 0, passed=(False, False), rewards=[0.0, 0.0]))
  for _ in range(2):
    curriculum.record(b, group(3, 0, passed=(False, False), rewards=[0.0, 0.0]))
  # Means 0.5 and 0 over their mean 0.25: scores 2 and 0; b is drawn at the floor, 0.1.
  assert curriculum.difficulty() == pytest.approx({"a/l1": 2.0, "b/l1": 0.0})
  tasks = make_tasks(("a", "b"), 40)
  assert share_of(curriculum, tasks, "a/l1") == pytest.approx(2.0 / 2.1, abs=0.02)
  lower_floor = Curriculum(start_group=0, window=64, weights={"informative": 1.0}, floor=1.0)
  lower_floor.load_state_dict(curriculum.state_dict())
  assert share_of(lower_floor, tasks, "a/l1") == pytest.approx(2.0 / 3.0, abs=0.04)


def test_parse_weights():
  assert parse_weights("turns=1, informative=2.5,") == {"turns": 1.0, "informative": 2.5}
  assert parse_weights("") == {}
  for bad, message in [("turns", "is not SIGNAL=WEIGHT"), ("turns=-1", "weight >= 0"),
                       ("turns=nan", "is not SIGNAL=WEIGHT"), ("pass=1", "unknown signals")]:
    with pytest.raises(ValueError, match=message):
      parse_weights(bad)
  with pytest.raises(ValueError, match="floor must be > 0"):
    Curriculum(floor=0.0)


def test_state_saved_before_the_informative_signal_loads():
  """A coordinator state from before `informative` existed has 3 signal columns and the count:
  the missing column loads as zeros and counts the groups recorded since."""
  old = {"groups_recorded": 2, "sums": {"a/l1": [6.0, 100.0, 1.0, 2.0]}}
  curriculum = Curriculum(start_group=0, weights={"turns": 1.0, "informative": 1.0})
  curriculum.load_state_dict(old)
  a = make_tasks(("a",), 1)[0]
  curriculum.record(a, group(4, 50, passed=(True, False)))
  assert curriculum.state_dict()["sums"]["a/l1"] == [10.0, 150.0, 1.5, 1.0, 3.0]
