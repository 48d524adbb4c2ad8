"""The coordinator's sample lifecycle over a fake backend (no model, no engine): the staleness bound
and what it implies (S = 0 is the synchronous algorithm, S >= 1 overlaps generation with
training), seeded determinism under random interleavings, retries, drops and their accounting,
restarts from the state dict and the pickled ready groups, and running out of tasks.

The learner is simulated as c2/rl/learner.py runs it: next_batch(step), train (a short sleep),
publish version step + 1 (the `latest_published` callable returns it)."""
import collections
import concurrent.futures
import itertools
import json
import os
import queue
import random
import threading
import time

import numpy as np
import pytest

from c2.envs.tasks import Task
from c2.rl.backends import Backend
from c2.rl.coordinator import Coordinator, OutOfTasksError, RolloutsFailingError, rollout_seed
from c2.rl.rollout import Rollout, Segment
from c2.rl.workers import WorkerDiedError

GROUP_SIZE, GROUPS_PER_STEP = 3, 2
STALL_SECONDS = 10.0  # a batch that takes longer means the coordinator stalled


def make_tasks(n, kinds=("a",)):
  return [Task(task_id=f"t{i:03d}", prompt=f"task {i}", tags=(f"kind:{kinds[i % len(kinds)]}",),
               level=1) for i in range(n)]


def seed_reward(spec):
  return (spec.seed % 3) / 2


def fake_rollout(spec, start, finish, reward_of=seed_reward):
  """Three prompt tokens, then four sampled ones: two with the weights the rollout started with
  and two with those it finished with, as a weight swap mid-rollout leaves them. The reward is a
  function of the spec alone (its seed by default), so a rollout run twice with its seed gives
  the same sample."""
  reward = reward_of(spec)
  segment = Segment(tokens=[1, 2, 3] + [10 + spec.index] * 4, model_mask=[False] * 3 + [True] * 4,
                    sampler_logp=[0.0] * 3 + [-0.5] * 4,
                    versions=[-1] * 3 + [start, start, finish, finish], routes=None)
  return Rollout(spec, [segment], reward, {"reward/total": reward}, reward == 1.0, "stopped",
                 {"turns": 1 + spec.seed % 4, "thinking_tokens": 10 * (spec.seed % 5)})


class FakeBackend(Backend):
  """Worker threads take submitted specs in order and sleep a seeded random while before they
  answer, so harvests, admissions and weight loads interleave differently from seed to seed.

  Fault injection: `fail(spec, attempt)` true fails that attempt; `stamp` (group id -> version)
  makes a group's tokens claim an old version; rollouts of the groups in `hold` wait for
  `release`. kill_engine fails every pending rollout, kill_env_worker the oldest one; a kill that
  finds none pending fails the next submission instead, so each kill fails something."""

  def __init__(self, *, workers=4, seed=0, max_sleep=0.01, load_delay=0.0, fail=None,
               stamp=None, hold=(), reward_of=seed_reward):
    self.max_sleep, self.load_delay, self.reward_of = max_sleep, load_delay, reward_of
    self.fail = fail or (lambda spec, attempt: False)
    self.stamp, self.hold = dict(stamp or {}), set(hold)
    self.release, self._closed = threading.Event(), threading.Event()
    self._rng = random.Random(seed)
    self._lock = threading.Lock()
    self._version = 0
    self._jobs = queue.Queue()
    self._pending = {}  # key -> "its worker died" flag, from submit until the answer is decided
    self._keys = itertools.count()
    self._doomed = 0
    self.submissions = []  # (spec, engine version at submission, time)
    self.loads = []  # versions the coordinator asked for, in order
    self.results = {}  # (group id, index) -> the last rollout answered
    self.attempts = collections.Counter()
    self.killed = 0
    for _ in range(workers):
      threading.Thread(target=self._work, daemon=True).start()

  def start(self, version):
    self._version = version

  def submit(self, spec, task):
    assert task.task_id == spec.task_id
    future, died = concurrent.futures.Future(), threading.Event()
    with self._lock:
      key = next(self._keys)
      self.attempts[spec.group_id, spec.index] += 1
      attempt = self.attempts[spec.group_id, spec.index]
      self.submissions.append((spec, self._version, time.perf_counter()))
      self._pending[key] = died
      if self._doomed:
        self._doomed -= 1
        self._kill([key])
    self._jobs.put((key, future, spec, attempt))
    return future

  def _work(self):
    while not self._closed.is_set():
      try:
        key, future, spec, attempt = self._jobs.get(timeout=0.05)
      except queue.Empty:
        continue
      if not future.set_running_or_notify_cancel():
        with self._lock:
          self._pending.pop(key, None)
        continue
      with self._lock:
        start, pause = self._version, self._rng.uniform(0, self.max_sleep)
      time.sleep(pause)
      while spec.group_id in self.hold and not self.release.wait(0.02):
        if self._closed.is_set():
          break
      with self._lock:  # the answer is decided here: a kill after this point misses it
        finish, died = self._version, self._pending.pop(key).is_set()
      version = self.stamp.get(spec.group_id)
      if died or self._closed.is_set() or self.fail(spec, attempt):
        future.set_exception(WorkerDiedError(f"worker of {spec} died (attempt {attempt})"))
        continue
      rollout = fake_rollout(spec, start if version is None else version,
                             finish if version is None else version, self.reward_of)
      self.results[spec.group_id, spec.index] = rollout
      future.set_result(rollout)

  def load_version(self, version):
    self.loads.append(version)

    def swap():
      with self._lock:
        self._version = max(self._version, version)

    if self.load_delay:  # engines take new weights a while after they are asked to
      timer = threading.Timer(self.load_delay, swap)
      timer.daemon = True
      timer.start()
    else:
      swap()

  def engine_version(self):
    with self._lock:
      return self._version

  def stats(self):
    return {}

  def _kill(self, keys):
    # A rollout already killed and not yet answered dies once: count it once.
    fresh = [key for key in keys if not self._pending[key].is_set()]
    for key in fresh:
      self._pending[key].set()
    self.killed += len(fresh)

  def kill_engine(self):
    with self._lock:
      if self._pending:
        self._kill(list(self._pending))
      else:
        self._doomed += 1

  def kill_env_worker(self):
    with self._lock:
      if self._pending:
        self._kill([min(self._pending)])
      else:
        self._doomed += 1

  def close(self):
    self._closed.set()

  # What the tests read back.
  def first_submission(self, group_id):
    """(engine version, time) when the group's first rollout was submitted: the group's start."""
    return next((v, t) for spec, v, t in self.submissions if spec.group_id == group_id)

  def submitted(self, group_id):
    return sorted((s.index, s.task_id, s.seed) for s, _, _ in self.submissions
                  if s.group_id == group_id)


class Published:
  """The weight store's latest_version, set by the simulated learner after each step."""

  def __init__(self, version=0):
    self.version, self.times = version, {version: time.perf_counter()}

  def __call__(self):
    return self.version

  def publish(self, version):
    self.times[version] = time.perf_counter()
    self.version = version


@pytest.fixture
def build(tmp_path):
  """Coordinator(backend, tasks, ...) with the test defaults; all are closed at the end."""
  made = []

  def make(backend, tasks, published, **overrides):
    kwargs = dict(group_size=GROUP_SIZE, groups_per_step=GROUPS_PER_STEP, max_staleness=1,
                  state_dir=str(tmp_path / "rl"), total_steps=20, seed=0, poll_seconds=0.002)
    kwargs.update(overrides)
    coordinator = Coordinator(backend, tasks, latest_published=published, **kwargs)
    made.append((coordinator, backend))
    return coordinator

  yield make
  for coordinator, backend in made:
    coordinator.close()
    backend.close()


def take(coordinator, step):
  """next_batch(step) on a daemon thread: a coordinator that stalls fails the test, not hangs it."""
  out = {}

  def call():
    try:
      out["groups"] = coordinator.next_batch(step)
    except Exception as e:  # pylint: disable=broad-except
      out["error"] = e

  thread = threading.Thread(target=call, daemon=True)
  thread.start()
  thread.join(STALL_SECONDS)
  assert not thread.is_alive(), f"next_batch({step}) stalled: {coordinator.accounting()}"
  if "error" in out:
    raise out["error"]
  return out["groups"]


def check_accounting(coordinator):
  a = coordinator.accounting()
  assert a["started"] == (a["trained"] + a["dropped_stale"] + a["dropped_failed"]
                          + a["dropped_uniform"] + a["ready"] + a["in_flight"]), a
  return a


def run_learner(coordinator, published, steps, *, first=0, train_seconds=0.01, on_step=None):
  """The learner's loop; returns [(step, groups, time the batch was taken)]."""
  log = []
  for step in range(first, first + steps):
    if on_step is not None:
      on_step(step)
    groups = take(coordinator, step)
    log.append((step, groups, time.perf_counter()))
    check_accounting(coordinator)
    time.sleep(train_seconds)
    published.publish(step + 1)
  return log


def trained_ids(log):
  ids = [g.group_id for _, groups, _ in log for g in groups]
  assert len(ids) == len(set(ids)), f"a group trained twice: {ids}"
  return ids


# ---------------------------------------------------------------------------------- staleness


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_staleness_bound_holds_and_overlap_follows_it(build, max_staleness):
  steps = 20
  backend = FakeBackend(seed=max_staleness, load_delay=0.003)
  published = Published()
  coordinator = build(backend, make_tasks(100), published, max_staleness=max_staleness,
                      total_steps=steps)
  coordinator.start(0)
  log = run_learner(coordinator, published, steps)

  for step, groups, _ in log:
    assert len(groups) == GROUPS_PER_STEP
    for group in groups:
      assert step - group.min_version <= max_staleness, (step, group.group_id)
      versions = [v for r in group.rollouts for s in r.segments for v, m
                  in zip(s.versions, s.model_mask) if m]
      assert versions and all(0 <= step - v <= max_staleness for v in versions)
      start_version, _ = backend.first_submission(group.group_id)
      assert start_version >= step - max_staleness
      if max_staleness == 0:  # synchronous: sampled with exactly the weights step s trains
        assert start_version == step and set(versions) == {step}
  assert len(trained_ids(log)) == steps * GROUPS_PER_STEP
  assert coordinator.counters["groups_dropped_stale"] == 0  # none started too early or too late
  assert coordinator.counters["pump_errors"] == 0
  # The pump takes the newest published version to the engines, each once, in order.
  assert backend.loads == sorted(set(backend.loads)) and backend.loads[0] == 0
  if max_staleness == 0:  # each step waits for its version, so none can be skipped
    assert backend.loads[:steps] == list(range(steps))

  # Overlap: groups for step s + 1 started while step s trained (before version s + 1 was out).
  started_early = [step for step, _, _ in log[:-1] if any(
      backend.first_submission(g.group_id)[1] < published.times[step + 1]
      for g in log[step + 1][1])]
  # ... or even before step s took its batch.
  started_before_batch = [step for step, _, taken in log[:-1] if any(
      backend.first_submission(g.group_id)[1] < taken for g in log[step + 1][1])]
  if max_staleness == 0:
    assert started_early == [] and started_before_batch == []
  else:
    assert len(started_early) >= (steps - 1) // 2, started_early
    if max_staleness >= 2:  # admitted one version earlier: before the previous batch was taken
      assert len(started_before_batch) >= (steps - 1) // 2, started_before_batch
    else:
      assert started_before_batch, "no generation overlapped a wait for a batch"


def test_synchronous_runs_repeat_under_any_interleaving(build, tmp_path):
  tasks = make_tasks(40)

  def run(seed, load_delay, state_dir):
    backend = FakeBackend(seed=seed, max_sleep=0.008, load_delay=load_delay)
    published = Published()
    coordinator = build(backend, tasks, published, max_staleness=0, total_steps=8,
                        state_dir=state_dir)
    coordinator.start(0)
    log = run_learner(coordinator, published, 8, train_seconds=0.002 * seed)
    return [[(g.group_id, g.task.task_id, [r.spec.seed for r in g.rollouts], g.rewards.tolist())
             for g in groups] for _, groups, _ in log]

  first = run(1, 0.0, str(tmp_path / "a"))
  assert first == run(2, 0.004, str(tmp_path / "b"))
  # And it is the synchronous schedule: step s trains the next tasks in order, seeded by group.
  for step, groups in enumerate(first):
    ids = [GROUPS_PER_STEP * step + k for k in range(GROUPS_PER_STEP)]
    assert [g[0] for g in groups] == ids
    assert [g[1] for g in groups] == [tasks[i].task_id for i in ids]
    assert [g[2] for g in groups] == [[rollout_seed(0, i, k) for k in range(GROUP_SIZE)]
                                      for i in ids]


# -------------------------------------------------------------------------- retries and drops


def test_retries_keep_the_seed_and_too_many_failures_drop_the_group(build):
  # Group 1's rollout 0 fails once (retried); group 3's rollout 2 always fails (dropped after
  # max_retries retries).
  def fail(spec, attempt):
    return (spec.group_id, spec.index) == (1, 0) and attempt == 1 or (
        (spec.group_id, spec.index) == (3, 2))

  backend = FakeBackend(seed=3, fail=fail)
  published = Published()
  coordinator = build(backend, make_tasks(40), published, max_retries=2, total_steps=6)
  coordinator.start(0)
  log = run_learner(coordinator, published, 6)

  ids = trained_ids(log)
  assert 1 in ids and 3 not in ids and len(ids) == 12
  c = coordinator.counters
  assert c["rollouts_failed"] == 1 + 3 and c["rollouts_retried"] == 1 + 2
  assert c["groups_dropped_failed"] == 1 and c["groups_dropped_stale"] == 0
  # Retried with the same seed: the same sample as if it had not failed.
  def seeds(group_id, index):
    return [seed for i, _, seed in backend.submitted(group_id) if i == index]

  assert seeds(1, 0) == [rollout_seed(0, 1, 0)] * 2
  assert seeds(3, 2) == [rollout_seed(0, 3, 2)] * 3
  group_1 = next(g for _, groups, _ in log for g in groups if g.group_id == 1)
  assert group_1.rewards.tolist() == [(rollout_seed(0, 1, k) % 3) / 2 for k in range(GROUP_SIZE)]
  assert not os.path.exists(coordinator._group_path(3))  # pylint: disable=protected-access
  a = check_accounting(coordinator)
  assert (a["trained"], a["dropped_failed"]) == (12, 1)


def test_killed_workers_fail_exactly_their_rollouts_which_are_retried(build):
  backend = FakeBackend(seed=4, workers=6)
  published = Published()
  # Retries to spare: one rollout can be hit by two of the kills (engine, then env worker).
  coordinator = build(backend, make_tasks(40), published, max_staleness=1, total_steps=8,
                      max_retries=5)
  coordinator.start(0)

  def on_step(step):
    if step == 2:
      backend.kill_engine()
    elif step in (4, 5):
      backend.kill_env_worker()

  log = run_learner(coordinator, published, 8, on_step=on_step)
  assert len(trained_ids(log)) == 16
  c = coordinator.counters
  assert backend.killed >= 3
  assert c["groups_dropped_failed"] == 0 and c["groups_dropped_stale"] == 0
  assert c["rollouts_failed"] == c["rollouts_retried"] == backend.killed
  for group_id in trained_ids(log):  # every attempt of a rollout had its one seed
    seeds = collections.defaultdict(set)
    for index, _, seed in backend.submitted(group_id):
      seeds[index].add(seed)
    assert all(s == {rollout_seed(0, group_id, i)} for i, s in seeds.items())


def test_a_cause_that_fails_every_rollout_ends_the_run_with_the_last_error(build):
  # Before the bound, such a run dropped group after group for as long as tasks lasted (a
  # data.seed=1 RL run spun for minutes on a seed overflow, logging tracebacks).
  backend = FakeBackend(seed=2, fail=lambda spec, attempt: True)
  coordinator = build(backend, make_tasks(40), Published(), max_retries=1,
                      max_failed_groups_in_a_row=3)
  coordinator.start(0)
  with pytest.raises(RolloutsFailingError, match=(
      r"(3|4|5) groups in a row were dropped because a rollout failed 2 times.*the last failure: "
      r"group \d+ \(task t\d+\): WorkerDiedError: worker of .* \(attempt 2\).*"
      r"rl.max_failed_groups_in_a_row")):
    take(coordinator, 0)
  a = check_accounting(coordinator)
  assert a["trained"] == 0 and a["dropped_failed"] >= 3
  # Every failed attempt was retried once, then its group dropped.
  assert coordinator.counters["rollouts_retried"] >= 3
  with pytest.raises(ValueError, match="max_failed_groups_in_a_row must be >= 1"):
    build(FakeBackend(), make_tasks(4), Published(), max_failed_groups_in_a_row=0)


def test_failures_between_finished_groups_do_not_end_the_run(build):
  # Every rollout of every third group fails: never two such drops without a group finishing
  # between them in the order groups are started, but harvests interleave, so the bound is 3.
  backend = FakeBackend(seed=4, fail=lambda spec, attempt: spec.group_id % 3 == 0)
  published = Published()
  coordinator = build(backend, make_tasks(60), published, max_retries=0,
                      max_failed_groups_in_a_row=3, total_steps=8)
  coordinator.start(0)
  ids = trained_ids(run_learner(coordinator, published, 8))
  assert len(ids) == 16 and not any(i % 3 == 0 for i in ids)
  assert check_accounting(coordinator)["dropped_failed"] >= 5


def test_should_stop_ends_a_wait_for_rollouts_and_the_groups_survive_it(build):
  backend = FakeBackend(seed=6, hold=range(100))  # no rollout finishes until released
  published = Published()
  coordinator = build(backend, make_tasks(40), published)
  coordinator.start(0)
  stop = threading.Event()
  threading.Timer(0.2, stop.set).start()
  started = time.perf_counter()
  assert coordinator.next_batch(0, should_stop=stop.is_set) is None
  assert 0.2 <= time.perf_counter() - started < STALL_SECONDS
  before = check_accounting(coordinator)
  assert before["in_flight"] >= GROUPS_PER_STEP and before["trained"] == 0
  backend.release.set()  # what was in flight still finishes and is trained
  ids = trained_ids(run_learner(coordinator, published, 2))
  assert sorted(ids)[:GROUPS_PER_STEP] == list(range(GROUPS_PER_STEP))
  check_accounting(coordinator)


def test_a_group_with_old_tokens_is_dropped_not_trained(build):
  # With S = 1, group 6 is admitted once the engines have version 2, so it can be used at step 2
  # at the earliest; its tokens claim version 0, a lag of at least 2.
  backend = FakeBackend(seed=5, stamp={6: 0})
  published = Published()
  coordinator = build(backend, make_tasks(40), published, max_staleness=1, total_steps=6)
  coordinator.start(0)
  log = run_learner(coordinator, published, 6)

  ids = trained_ids(log)
  assert 6 not in ids and len(ids) == 12
  assert coordinator.counters["groups_dropped_stale"] == 1
  assert coordinator.counters["rollouts_dropped_stale"] == GROUP_SIZE
  assert not os.path.exists(coordinator._group_path(6))  # pylint: disable=protected-access
  for step, groups, _ in log:
    assert all(step - g.min_version <= 1 for g in groups)
  assert check_accounting(coordinator)["dropped_stale"] == 1


def split_reward(spec):
  """Groups by id mod 3: all fail alike (uniform rewards); all fail, one with a penalty (uniform
  outcome, rewards differ); only rollout 0 passes (mixed). A rollout passes at reward 1."""
  return [0.0, -0.1 * (spec.index == 0), float(spec.index == 0)][spec.group_id % 3]


def dropped_by(mode, group_id):
  return group_id % 3 == 0 or (mode == "outcome" and group_id % 3 == 1)


@pytest.mark.parametrize("mode", ["reward", "outcome"])
def test_uniform_groups_are_dropped_and_replaced_by_new_tasks(build, mode):
  steps = 8
  backend = FakeBackend(seed=6, reward_of=split_reward)
  published = Published()
  coordinator = build(backend, make_tasks(200), published, total_steps=steps,
                      drop_uniform_groups=mode)
  coordinator.start(0)
  log = run_learner(coordinator, published, steps)

  ids = trained_ids(log)
  assert len(ids) == steps * GROUPS_PER_STEP  # every step still got full batches
  assert not any(dropped_by(mode, i) for i in ids)
  if mode == "reward":  # all-failed groups whose rewards differ are trained
    assert any(i % 3 == 1 for i in ids)
  for _, groups, _ in log:
    assert all(np.ptp(g.rewards) > 0 for g in groups)
  # Every finished uniform group was dropped, and its task is not used again.
  finished = {gid for gid, _ in backend.results}
  dropped = sorted(i for i in finished if dropped_by(mode, i) and all(
      (i, k) in backend.results for k in range(GROUP_SIZE)))
  assert len(dropped) >= steps * GROUPS_PER_STEP // 2 - 1
  c = coordinator.counters
  assert c["groups_dropped_uniform"] == len(dropped)
  assert not set(dropped) & set(ids)
  a = check_accounting(coordinator)
  assert a["dropped_uniform"] == len(dropped)
  # The sampling log keeps the dropped groups' rollouts: the unfiltered pass rate.
  logged = coordinator.drain_rollout_log()
  assert {r["group"] for r in logged} >= set(dropped) | set(ids)
  assert coordinator.drain_rollout_log() == []  # drained


def test_without_dropping_uniform_groups_are_trained(build):
  backend = FakeBackend(seed=6, reward_of=split_reward)
  published = Published()
  coordinator = build(backend, make_tasks(200), published, total_steps=8)
  coordinator.start(0)
  log = run_learner(coordinator, published, 8)
  assert sorted(trained_ids(log)) == list(range(16))  # uniform or not
  assert coordinator.counters["groups_dropped_uniform"] == 0
  with pytest.raises(ValueError, match="drop_uniform_groups"):
    build(backend, make_tasks(4), published, drop_uniform_groups="yes")


# ------------------------------------------------------------------------------------ restart


def pickled_ids(coordinator):
  return sorted(int(name[:-4]) for name in os.listdir(coordinator.group_dir)
                if name.endswith(".pkl"))


def test_restart_reuses_ready_groups_and_restarts_those_in_flight(build):
  tasks = make_tasks(40)
  # Run A: S = 1, steps 0 and 1 trained. After version 2 is out, groups 4, 5 (for step 2) and
  # 6, 7 (for step 3) run; group 7 never finishes before the "crash".
  backend_a = FakeBackend(seed=6, workers=8, hold={7})
  published = Published()
  first = build(backend_a, tasks, published, total_steps=4)
  first.start(0)
  log_a = run_learner(first, published, 1)
  first.forget_trained()  # the learner's checkpoint after step 0: groups 0 and 1 go
  assert not {0, 1} & set(pickled_ids(first))
  log_a += run_learner(first, published, 1, first=1)  # trained, not yet forgotten
  deadline = time.time() + STALL_SECONDS
  while (first.accounting()["ready"], first.accounting()["in_flight"]) != (3, 1):
    assert time.time() < deadline, first.accounting()
    time.sleep(0.005)
  assert pickled_ids(first) == [2, 3, 4, 5, 6]
  state = json.loads(json.dumps(first.state_dict()))  # goes into the learner's JSON checkpoint
  first.close()
  backend_a.close()
  assert sorted(map(int, state["started"])) == [4, 5, 6, 7]

  # Run B over the same state dir, resumed at step 2.
  backend_b = FakeBackend(seed=7, workers=8)
  backend_b.start(2)
  second = build(backend_b, tasks, published, total_steps=4)
  second.load_state_dict(state)
  second.start(2)
  check_accounting(second)
  log_b = run_learner(second, published, 2, first=2)

  assert [[g.group_id for g in groups] for _, groups, _ in log_b] == [[4, 5], [6, 7]]
  # Ready groups came from disk, exactly as generated; only group 7 was generated again, with
  # its task and seeds.
  assert {s.group_id for s, _, _ in backend_b.submissions} == {7}
  assert backend_b.submitted(7) == backend_a.submitted(7)
  assert second.counters["groups_loaded_from_disk"] == 3
  for _, groups, _ in log_b:
    for g in groups:
      if g.group_id != 7:
        assert [r.spec for r in g.rollouts] == [backend_a.results[g.group_id, k].spec
                                               for k in range(GROUP_SIZE)]
        assert g.rewards.tolist() == [backend_a.results[g.group_id, k].reward
                                      for k in range(GROUP_SIZE)]
  all_ids = trained_ids(log_a + log_b)
  assert sorted(all_ids) == list(range(8))
  a = check_accounting(second)
  assert (a["started"], a["trained"], a["ready"], a["in_flight"]) == (8, 8, 0, 0)
  second.forget_trained()
  assert pickled_ids(second) == []


# ----------------------------------------------------------------------------- running out


def test_group_size_below_two_is_refused(build):
  with pytest.raises(ValueError, match="group_size"):
    build(FakeBackend(), make_tasks(4), Published(), group_size=1)


@pytest.mark.parametrize("num_tasks", [4, 3])  # used up exactly; one group short of a batch
def test_out_of_tasks_raises_with_a_helpful_message(build, num_tasks):
  backend = FakeBackend(seed=8)
  published = Published()
  coordinator = build(backend, make_tasks(num_tasks), published, max_staleness=0, total_steps=5)
  coordinator.start(0)
  run_learner(coordinator, published, 1)
  if num_tasks == 4:
    run_learner(coordinator, published, 1, first=1)
  with pytest.raises(OutOfTasksError, match=r"no tasks left for step \d.*rl.train_tasks"):
    take(coordinator, num_tasks // GROUPS_PER_STEP)
  check_accounting(coordinator)
