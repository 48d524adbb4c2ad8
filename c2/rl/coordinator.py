"""The sample lifecycle: task -> group of G rollouts -> rewards -> a training batch, with a bound on
policy lag, retries of failed rollouts, checkpoints of ready groups, and a curriculum hook.

    coordinator = Coordinator(backend, tasks, group_size=8, groups_per_step=4, max_staleness=1,
                              state_dir=workdir + "/rl", latest_published=store.latest_version)
    groups = coordinator.next_batch(step)        # blocks; keeps the engine fed meanwhile
    ... train ..., then checkpoint with coordinator.state_dict(); coordinator.forget_trained()

Staleness. The learner trains step s with policy version s and publishes version s + 1 after it.
A group meant for step t is only started once the engines sample with version >= t - S (S =
`max_staleness`), so its tokens are at most S versions old when step t uses it; a group that is
used later than planned (after a drop), with a token older than s - S, is dropped and counted,
never trained. With S = 0 no rollout overlaps an update: the run is the synchronous algorithm,
step for step (tests/rl/test_coordinator.py checks it against a synchronous loop).

Uniform groups. With drop_uniform_groups="reward", a group whose rollouts all got the same reward
is dropped when it finishes and another task is started in its place (ScaleRL's zero-variance
filtering): its advantages R - mean(R) are all zero, so it would take a batch slot and learner
time and move nothing. "outcome" also drops groups whose rollouts all passed or all failed
(DAPO's dynamic sampling), where only penalties or lengths separate the rewards. A dropped
group's rollouts still count in the curriculum and in `drain_rollout_log()`, which is what the
pass rate of sampling should be read from.

Faults. A rollout whose worker dies (WorkerDiedError, or any exception from the backend) is
retried with the same seed up to `max_retries` times, then its group is dropped and counted.
A cause that fails every rollout (a bug, a bad setting) would drop group after group for as long
as tasks last: after `max_failed_groups_in_a_row` groups dropped that way with no group finishing
between them, `next_batch` raises RolloutsFailingError with the last failure instead.
Every group ends in exactly one of: trained, dropped_stale, dropped_failed, dropped_uniform;
`accounting()` says where each started group is, and the learner asserts that nothing is lost.

Checkpoints. Each ready group is pickled to state_dir/groups/ (atomically) with its rollouts and
their versions. `state_dict()` (saved with the learner checkpoint) records the groups started and
trained; after a restart, ready groups on disk are loaded instead of regenerated, and groups that
were in flight are started again with the same task and seeds. Each task is used once.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import pickle
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from c2.envs.tasks import Task
from c2.rl.backends import Backend
from c2.rl.curriculum import Curriculum
from c2.rl.rollout import Rollout, RolloutSpec


@dataclasses.dataclass
class Group:
  group_id: int
  task: Task
  target_step: int
  rollouts: list[Optional[Rollout]]
  attempts: list[int]

  @property
  def ready(self) -> bool:
    return all(r is not None for r in self.rollouts)

  @property
  def rewards(self) -> np.ndarray:
    return np.array([r.reward for r in self.rollouts], np.float32)

  @property
  def min_version(self) -> int:
    return min(r.min_version for r in self.rollouts)


class OutOfTasksError(RuntimeError):
  pass


class RolloutsFailingError(RuntimeError):
  """Groups keep being dropped because their rollouts fail: the cause is not a single worker."""


DROP_MODES = ("off", "reward", "outcome")


def is_uniform(group: Group, mode: str) -> bool:
  """Whether `mode` (DROP_MODES) drops this finished group."""
  if mode == "off":
    return False
  if np.ptp(group.rewards) == 0:
    return True
  return mode == "outcome" and len({r.passed for r in group.rollouts}) == 1


def rollout_seed(seed: int, group_id: int, index: int) -> int:
  return ((seed * 1_000_003 + group_id) * 4096 + index) % (2**31 - 1)


class Coordinator:
  """See the module docstring. Thread-safe: a pump thread admits and harvests while the learner
  trains; `next_batch` is called from the learner's thread."""

  def __init__(self, backend: Backend, tasks: Sequence[Task], *, group_size: int,
               groups_per_step: int, max_staleness: int, state_dir: str,
               latest_published: Callable[[], Optional[int]], total_steps: int,
               max_retries: int = 2, seed: int = 0, curriculum: Optional[Curriculum] = None,
               drop_uniform_groups: str = "off", max_failed_groups_in_a_row: int = 8,
               poll_seconds: float = 0.02):
    if group_size < 2:
      raise ValueError("rl.group_size must be >= 2 (advantages are relative to the group mean)")
    self.backend, self.group_size, self.groups_per_step = backend, group_size, groups_per_step
    self.max_staleness, self.max_retries, self.seed = max_staleness, max_retries, seed
    if drop_uniform_groups not in DROP_MODES:
      raise ValueError(f"drop_uniform_groups={drop_uniform_groups!r}; choose one of {DROP_MODES}")
    self.drop_uniform_groups = drop_uniform_groups
    if max_failed_groups_in_a_row < 1:
      raise ValueError(f"rl.max_failed_groups_in_a_row must be >= 1, got "
                       f"{max_failed_groups_in_a_row}")
    self.max_failed_groups_in_a_row = max_failed_groups_in_a_row
    self._failed_in_a_row, self._last_failure = 0, ""
    self.latest_published, self.total_steps = latest_published, total_steps
    self.curriculum = curriculum or Curriculum()
    self.tasks = {task.task_id: task for task in tasks}
    self._unused = [task.task_id for task in tasks]  # in order; the curriculum picks among them
    self.group_dir = os.path.join(state_dir, "groups")
    os.makedirs(self.group_dir, exist_ok=True)
    self._lock = threading.RLock()
    self._groups: dict[int, Group] = {}  # started, not yet trained or dropped
    self._ready: list[int] = []
    self._futures: dict[concurrent.futures.Future, tuple[int, int]] = {}
    self._next_group_id = 0
    self._planned = collections.Counter()  # target step -> groups started for it and alive
    self._step = 0  # the step the learner is on (admission looks ahead of it)
    self._requested_version = -1
    self.trained: set[int] = set()
    self.counters = collections.Counter()
    self._rollout_log: list[dict] = []  # per finished rollout since the last drain
    self._stop = threading.Event()
    self._pump_thread: Optional[threading.Thread] = None
    self._poll = poll_seconds

  # ------------------------------------------------------------------------------ learner API
  def start(self, step: int) -> None:
    """Starts the pump thread at the learner's `step` (after load_state_dict on a resume)."""
    self._step = step
    self._load_ready_groups()
    self._pump_thread = threading.Thread(target=self._pump_forever, name="coordinator",
                                         daemon=True)
    self._pump_thread.start()

  def next_batch(self, step: int, should_stop: Optional[Callable[[], bool]] = None
                 ) -> Optional[list[Group]]:
    """The `groups_per_step` ready groups planned for `step` (or, after drops and restarts, for
    an earlier step), oldest first; blocks until they are ready. Groups planned for later steps
    wait for theirs: taking one early would leave an older group to go stale. Returns None when
    `should_stop()` turns true while the batch is not ready (SIGTERM during a wait for rollouts:
    the learner saves now rather than after rollouts that may take minutes)."""
    with self._lock:
      self._step = step
    while True:
      with self._lock:
        self._drop_stale(step)
        eligible = sorted((self._groups[i].target_step, i) for i in self._ready
                          if self._groups[i].target_step <= step)
        if len(eligible) >= self.groups_per_step:
          ids = [i for _, i in eligible[:self.groups_per_step]]
          self._ready = [i for i in self._ready if i not in ids]
          batch = [self._groups.pop(i) for i in ids]
          for group in batch:
            self._planned[group.target_step] -= 1
            self.trained.add(group.group_id)
          self.counters["groups_trained"] += len(batch)
          self._step = step + 1  # nothing more is planned for this step
          return batch
        if self._failed_in_a_row >= self.max_failed_groups_in_a_row:
          raise RolloutsFailingError(
              f"{self._failed_in_a_row} groups in a row were dropped because a rollout failed "
              f"{self.max_retries + 1} times, with no group finishing between them; the last "
              f"failure: {self._last_failure}. A dead worker fails only its own rollouts: fix "
              "the cause (rl.max_failed_groups_in_a_row sets how many such drops end the run)")
        planned_here = sum(1 for g in self._groups.values() if g.target_step <= step)
        if not self._unused and planned_here < self.groups_per_step:
          raise OutOfTasksError(
              f"no tasks left for step {step}: {len(self.trained)} groups trained, "
              f"{self.counters['groups_dropped_uniform']} dropped as uniform; give more tasks "
              "(rl.train_tasks) or fewer steps")
      if should_stop is not None and should_stop():
        return None
      if self._pump_thread is None:
        self.pump()
      time.sleep(self._poll)

  def state_dict(self) -> dict:
    """JSON state for the learner checkpoint: groups trained and started, tasks used."""
    with self._lock:
      return {"next_group_id": self._next_group_id, "trained": sorted(self.trained),
              "started": {str(g.group_id): [g.task.task_id, g.target_step]
                          for g in self._groups.values()},
              "unused": list(self._unused), "counters": dict(self.counters),
              "curriculum": self.curriculum.state_dict()}

  def load_state_dict(self, state: dict) -> None:
    with self._lock:
      self._next_group_id = state["next_group_id"]
      self.trained = set(state["trained"])
      self._unused = [t for t in state["unused"] if t in self.tasks]
      self.counters = collections.Counter(state["counters"])
      self.curriculum.load_state_dict(state.get("curriculum", {}))
      for gid, (task_id, target) in state["started"].items():
        if os.path.exists(self._group_path(int(gid))):
          continue  # ready: start() loads it from disk, so its rollouts are not run again
        self._restart_group(int(gid), self.tasks[task_id], target)

  def forget_trained(self) -> None:
    """Deletes the files of trained groups (call once a checkpoint that counts them is saved)."""
    with self._lock:
      for gid in self.trained:
        path = self._group_path(gid)
        if os.path.exists(path):
          os.remove(path)

  def accounting(self) -> dict:
    with self._lock:
      c = self.counters
      in_flight = sum(1 for g in self._groups.values() if not g.ready)
      return {"started": c["groups_started"], "trained": c["groups_trained"],
              "dropped_stale": c["groups_dropped_stale"],
              "dropped_failed": c["groups_dropped_failed"],
              "dropped_uniform": c["groups_dropped_uniform"], "ready": len(self._ready),
              "in_flight": in_flight}

  def drain_rollout_log(self) -> list[dict]:
    """{group, reward, passed, **stats} of every rollout finished since the last call, whether
    its group is trained or dropped: the unfiltered view of what the policy samples."""
    with self._lock:
      log, self._rollout_log = self._rollout_log, []
      return log

  def close(self) -> None:
    self._stop.set()
    if self._pump_thread is not None:
      self._pump_thread.join(timeout=10)
    for future in list(self._futures):
      future.cancel()

  # ------------------------------------------------------------------------------- internals
  def _pump_forever(self) -> None:
    while not self._stop.is_set():
      try:
        self.pump()
      except Exception as e:  # pylint: disable=broad-except
        self.counters["pump_errors"] += 1
        self.last_error = e
      time.sleep(self._poll)

  def pump(self) -> None:
    """Takes new weights to the engines, harvests finished rollouts, starts new groups."""
    latest = self.latest_published()
    if latest is not None and latest > self._requested_version:
      self._requested_version = latest
      self.backend.load_version(latest)
    with self._lock:
      for future in [f for f in self._futures if f.done()]:
        self._harvest(future, *self._futures.pop(future))
      self._admit()

  def _admit(self) -> None:
    version = self.backend.engine_version()
    step = self._step
    while self._unused:
      target = step
      while self._planned[target] >= self.groups_per_step:
        target += 1
      if target >= self.total_steps or target - version > self.max_staleness:
        return
      task_id = self.curriculum.choose(self._unused, [self.tasks[t] for t in self._unused],
                                       rng_seed=self.seed + self._next_group_id)
      self._unused.remove(task_id)
      self._restart_group(self._next_group_id, self.tasks[task_id], target)  # advances the id
      self.counters["groups_started"] += 1

  def _restart_group(self, group_id: int, task: Task, target: int) -> None:
    if task.task_id in self._unused:
      self._unused.remove(task.task_id)
    self._next_group_id = max(self._next_group_id, group_id + 1)
    group = Group(group_id, task, target, [None] * self.group_size, [0] * self.group_size)
    self._groups[group_id] = group
    self._planned[target] += 1
    for index in range(self.group_size):
      self._submit(group, index)

  def _submit(self, group: Group, index: int) -> None:
    spec = RolloutSpec(group.group_id, index, group.task.task_id,
                       rollout_seed(self.seed, group.group_id, index))
    group.attempts[index] += 1
    self._futures[self.backend.submit(spec, group.task)] = (group.group_id, index)

  def _harvest(self, future, group_id: int, index: int) -> None:
    group = self._groups.get(group_id)
    if group is None or future.cancelled():  # its group was dropped meanwhile
      return
    try:
      rollout = future.result()
    except Exception as e:  # pylint: disable=broad-except
      self.counters["rollouts_failed"] += 1
      if group.attempts[index] <= self.max_retries:
        self.counters["rollouts_retried"] += 1
        self._submit(group, index)
      else:
        self._drop(group, "dropped_failed", reason=f"{type(e).__name__}: {e}")
      return
    group.rollouts[index] = rollout
    self._rollout_log.append({"group": group_id, "reward": rollout.reward,
                              "passed": rollout.passed, **rollout.stats})
    if group.ready:
      self._failed_in_a_row = 0
      self.curriculum.record(group.task, group.rollouts)
      if is_uniform(group, self.drop_uniform_groups):
        self._drop(group, "dropped_uniform")  # frees its slot: _admit starts another task
        return
      self._save_group(group)
      self._ready.append(group_id)
      self._ready.sort()

  def _drop(self, group: Group, kind: str, reason: str = "") -> None:
    if kind == "dropped_failed":
      self._failed_in_a_row += 1
      self._last_failure = f"group {group.group_id} (task {group.task.task_id}): {reason}"
    self._groups.pop(group.group_id, None)
    self._planned[group.target_step] -= 1
    self.counters[f"groups_{kind}"] += 1
    for future, (gid, _) in list(self._futures.items()):
      if gid == group.group_id:
        future.cancel()
        self._futures.pop(future)
    path = self._group_path(group.group_id)
    if os.path.exists(path):
      os.remove(path)

  def _drop_stale(self, step: int) -> None:
    for gid in list(self._ready):
      group = self._groups[gid]
      if step - group.min_version > self.max_staleness:
        self._ready.remove(gid)
        self.counters["rollouts_dropped_stale"] += self.group_size
        self._drop(group, "dropped_stale")

  def _group_path(self, group_id: int) -> str:
    return os.path.join(self.group_dir, f"{group_id:09d}.pkl")

  def _save_group(self, group: Group) -> None:
    path = self._group_path(group.group_id)
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as f:
      pickle.dump(group, f)
    os.replace(temporary, path)

  def _load_ready_groups(self) -> None:
    """Ready groups on disk that were not trained: used as they are, not regenerated."""
    with self._lock:
      for name in sorted(os.listdir(self.group_dir)):
        if not name.endswith(".pkl"):
          continue
        with open(os.path.join(self.group_dir, name), "rb") as f:
          group: Group = pickle.load(f)
        if group.group_id in self.trained:
          continue
        previous = self._groups.get(group.group_id)
        if previous is not None:  # restarted from the state dict: cancel its regeneration
          self._planned[previous.target_step] -= 1
          for future, (gid, _) in list(self._futures.items()):
            if gid == group.group_id:
              future.cancel()
              self._futures.pop(future)
        elif group.task.task_id in self._unused:  # started after the checkpoint: count it
          self.counters["groups_started"] += 1
        if group.task.task_id in self._unused:
          self._unused.remove(group.task.task_id)
        self._next_group_id = max(self._next_group_id, group.group_id + 1)
        self._groups[group.group_id] = group
        self._planned[group.target_step] += 1
        self._ready.append(group.group_id)
        self.counters["groups_loaded_from_disk"] += 1
      self._ready.sort()
