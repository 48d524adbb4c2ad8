"""RayBackend: rollouts through engine and env worker actors, identical to ThreadBackend's; weight
versions; killed engines and env workers fail their rollouts and are replaced.

One backend (one local Ray instance, one engine and two env worker actors) serves the module; it
reads a copy of the rl_world weight store, so publishing version 1 here disturbs no other test.
The tests do not depend on each other's order (pytest-xdist may split them). The slow test kills
actors behind the backend's back, as a crash would, and checks that it notices.
"""
import concurrent.futures
import dataclasses
import math
import shutil
import time

import jax
import numpy as np
import pytest
import ray

from c2.rl import publication
from c2.rl import ray_backend  # ray is in the `test` extra (and `rl`): no skip, CI runs this
from c2.rl.backends import ThreadBackend, make_backend
from c2.rl.rollout import Rollout, RolloutSpec
from c2.rl.workers import WorkerDiedError

TIMEOUT_S = 120  # first rollouts include the engine actor's compile on a shared 2-core machine
VERSION_POLL_S = ray_backend.VERSION_CACHE_S  # engine_version() answers from a cache this long
# ray.init and the sandbox spawn processes with fork+exec, which JAX's fork warning cannot tell
# from a bare fork.
# Slow: Ray start-up and its actors cost ~70 s of the default suite; ThreadBackend covers the
# same contract there, and .ci/run runs these after the default suite.
pytestmark = [pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning"), pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_world(rl_world, tmp_path_factory):
  store_dir = str(tmp_path_factory.mktemp("ray_store") / "weights")
  shutil.copytree(rl_world.store_dir, store_dir)
  spec = dataclasses.replace(rl_world.spec, store_dir=store_dir)
  backend = make_backend("ray", spec, env_workers=2, engines=1)
  backend.start(0)
  yield spec, backend
  backend.close()


def rollout_specs(group_id, tasks, n=2):
  """Rollout i of the group is on tasks[i], seeded by (group, i) as the coordinator does."""
  return [(RolloutSpec(group_id, i, tasks[i].task_id, seed=1000 * group_id + i), tasks[i])
          for i in range(n)]


def run(backend, specs):
  futures = [backend.submit(s, task) for s, task in specs]
  return [f.result(timeout=TIMEOUT_S) for f in futures]


def check_rollout(rollout):
  assert isinstance(rollout, Rollout) and rollout.segments
  assert rollout.sampled_tokens > 0
  for seg in rollout.segments:
    n = len(seg.tokens)
    assert len(seg.model_mask) == len(seg.sampler_logp) == len(seg.versions) == n
    logp = np.asarray(seg.sampler_logp)[np.asarray(seg.model_mask)]
    assert np.all(np.isfinite(logp)) and np.all(logp <= 0)
    assert seg.routes is not None and seg.routes.shape[0] == n and seg.routes.dtype == np.uint16


def test_rollouts_match_thread_backend(ray_world, rl_world):
  spec, backend = ray_world
  specs = rollout_specs(1, rl_world.tasks)
  version = backend.engine_version()  # 0, or 1 if the version test ran first on this worker
  threads = ThreadBackend(spec, env_workers=2)
  threads.start(version)
  try:  # both at once: the driver's compile overlaps the engine actor's
    ray_futures = [backend.submit(s, task) for s, task in specs]
    thread_rollouts = run(threads, specs)
    ray_rollouts = [f.result(timeout=TIMEOUT_S) for f in ray_futures]
  finally:
    threads.close()
  for got, want in zip(ray_rollouts, thread_rollouts):
    check_rollout(got)
    assert got.spec == want.spec
    # Sampling is seeded per request and position: same weights, same ids, whatever the process.
    assert [s.tokens for s in got.segments] == [s.tokens for s in want.segments]
    for a, b in zip(got.segments, want.segments):
      np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=1e-5)
      np.testing.assert_array_equal(a.routes, b.routes)


@pytest.mark.slow  # the same contract as ThreadBackend's default tests; Ray costs ~15 s each
def test_load_version(ray_world, rl_world):
  spec, backend = ray_world
  store = publication.WeightStore(spec.store_dir)
  if store.latest_version() < 1:
    store.publish(1, jax.tree.map(lambda x: x + 0.01 if x.dtype.kind == "f" else x,
                                  rl_world.params))
  backend.load_version(1)
  deadline = time.monotonic() + TIMEOUT_S
  while backend.engine_version() < 1:  # an idle engine reports a version once it has loaded it
    assert time.monotonic() < deadline, "the engine never reached version 1"
    time.sleep(VERSION_POLL_S)
  rollout, = run(backend, rollout_specs(6, rl_world.tasks, n=1))
  assert rollout.min_version == rollout.max_version == 1
  assert backend.stats()["engine/version"] == 1


def expect_died(futures):
  """Every future fails; a worker's death shows as WorkerDiedError."""
  for future in futures:
    with pytest.raises(Exception) as info:
      future.result(timeout=TIMEOUT_S)
    assert isinstance(info.value, WorkerDiedError), repr(info.value)


@pytest.mark.slow  # the same contract as ThreadBackend's default tests; Ray costs ~15 s each
def test_kill_engine_fails_rollouts_and_replaces_it(ray_world, rl_world):
  _, backend = ray_world
  before = backend.stats()["workers/engine_restarts"]
  futures = [backend.submit(s, task) for s, task in rollout_specs(2, rl_world.tasks)]
  backend.kill_engine()
  expect_died(futures)
  for rollout in run(backend, rollout_specs(3, rl_world.tasks)):
    check_rollout(rollout)
  assert backend.stats()["workers/engine_restarts"] == before + 1


@pytest.mark.slow  # the same contract as ThreadBackend's default tests; Ray costs ~15 s each
def test_kill_env_worker_fails_its_rollout_and_replaces_it(ray_world, rl_world):
  _, backend = ray_world
  before = backend.stats()["workers/env_restarts"]
  futures = [backend.submit(s, task) for s, task in rollout_specs(4, rl_world.tasks)]
  backend.kill_env_worker()  # one rollout per env worker: exactly one of the two dies
  done, _ = concurrent.futures.wait(futures, timeout=TIMEOUT_S)
  assert len(done) == 2
  failed = [f for f in futures if f.exception() is not None]
  assert len(failed) == 1
  expect_died(failed)
  check_rollout([f for f in futures if f not in failed][0].result())
  for rollout in run(backend, rollout_specs(5, rl_world.tasks)):
    check_rollout(rollout)
  assert backend.stats()["workers/env_restarts"] == before + 1
  assert math.isfinite(backend.stats()["engine/tokens_per_sec"])


@pytest.mark.slow
def test_crashed_actors_are_detected_and_replaced(ray_world, rl_world):
  """Actors that die without the backend's kill_* (a real crash): the failed rollouts tell it."""
  _, backend = ray_world
  before = dict(backend.restarts)
  ray.kill(backend._engines[0].handle)  # pylint: disable=protected-access
  expect_died([backend.submit(s, task) for s, task in rollout_specs(7, rl_world.tasks)])
  for rollout in run(backend, rollout_specs(8, rl_world.tasks)):
    check_rollout(rollout)
  futures = [backend.submit(s, task) for s, task in rollout_specs(9, rl_world.tasks, n=1)]
  busy = max(backend._envs, key=lambda a: a.in_flight)  # pylint: disable=protected-access
  ray.kill(busy.handle)
  expect_died(futures)
  for rollout in run(backend, rollout_specs(10, rl_world.tasks)):
    check_rollout(rollout)
  assert backend.restarts == {"engine": before["engine"] + 1, "env": before["env"] + 1}
