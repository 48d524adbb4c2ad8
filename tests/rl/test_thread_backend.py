"""The thread backend over the real small model (random weights: the replies are junk, which is
fine): what a rollout carries back, seeded determinism, weights swapped from the store by
version, and the two faults (a dead engine, a dead environment worker) failing exactly the
rollouts they held. One backend serves the module, on a copy of the world's weight store so that
publishing version 1 here leaves the other modules' store alone."""
import dataclasses
import shutil
import threading
import time

import jax
import numpy as np
import pytest

from c2.data import chat
from c2.envs.environment import CodingEnv
from c2.model.router import NOT_RECORDED
from c2.rl import publication
from c2.rl.backends import ThreadBackend
from c2.rl.rollout import RolloutSpec
from c2.rl import workers
from c2.rl.workers import WorkerDiedError

UNRECORDED = np.array(NOT_RECORDED).astype(np.uint16)  # 65535: -1 as the uint16 record stores it
TIMEOUT = 120  # seconds for one rollout future; a rollout takes well under a second once compiled


@pytest.fixture(scope="module")
def backend(rl_world, tmp_path_factory):
  store_dir = tmp_path_factory.mktemp("rl_backend") / "weights"
  shutil.copytree(rl_world.store_dir, store_dir)
  spec = dataclasses.replace(rl_world.spec, store_dir=str(store_dir))
  backend = ThreadBackend(spec, env_workers=4)
  backend.start(0)
  yield backend
  backend.close()


def generation_prompt(backend, task):
  env = CodingEnv(task, backend.spec.env)
  try:
    return chat.render_generation_prompt(backend.tokenizer, env.reset(), env.tool_schemas(),
                                         thinking=backend.spec.env.thinking)
  finally:
    env.close()


def rollout_of(backend, task, *, group=0, index=0, seed=0):
  spec = RolloutSpec(group, index, task.task_id, seed)
  return backend.submit(spec, task).result(timeout=TIMEOUT)


class EngineGate:
  """Stalls the backend's current engine until every request in `request_ids` has reached it,
  then holds its thread after the next step (the requests admitted, far from done) until
  `release` is set: the requests stay in flight for as long as the test needs, so a kill cannot
  race their completion."""

  def __init__(self, monkeypatch, backend, request_ids, release=None):
    self.host = backend._current_engine()  # pylint: disable=protected-access
    self.release = release if release is not None else threading.Event()
    self.held = threading.Event()
    engine, pending = self.host.engine, set(request_ids)
    submit, step = engine.submit, engine.step

    def gated_submit(request):
      # Request ids are "<rollout>-<turn>-<attempt suffix>" (c2/rl/rollout.py): match the stem.
      pending.discard(request.id.rsplit("-", 1)[0])
      return submit(request)

    def gated_step():
      if pending:  # some have come, not all: wait for the rest rather than run the first ones
        time.sleep(0.005)
        return []
      events = step()
      if not self.held.is_set():
        self.held.set()
        self.release.wait(TIMEOUT)
      return events

    # Instance attributes shadow the methods for the engine's own thread (c2.infer.server).
    monkeypatch.setattr(engine, "submit", gated_submit)
    monkeypatch.setattr(engine, "step", gated_step)


def check_rollout(rollout, spec, prompt, world, version):
  cfg = world.cfg
  assert rollout.spec == spec
  assert rollout.segments and rollout.stats["turns"] >= 1 and np.isfinite(rollout.reward)
  seg = rollout.segments[0]
  n = len(seg.tokens)
  assert seg.tokens[:len(prompt)] == prompt
  assert len(seg.model_mask) == len(seg.sampler_logp) == len(seg.versions) == n
  mask = np.array(seg.model_mask)
  logp, versions = np.array(seg.sampler_logp), np.array(seg.versions)
  assert not mask[:len(prompt)].any() and mask[len(prompt)]  # the first reply starts right there
  assert mask.sum() == rollout.sampled_tokens == rollout.stats["sampled_tokens"]
  assert mask.sum() <= world.spec.sampling.max_new_tokens * rollout.stats["turns"]
  assert np.isfinite(logp[mask]).all() and (logp[mask] <= 0).all() and (logp[mask] < 0).any()
  assert (logp[~mask] == 0).all()
  assert (versions[mask] == version).all() and (versions[~mask] == -1).all()
  assert all(0 <= t < cfg.vocab_size for t in seg.tokens)
  # Routes: every position before the last sampled token was fed to the engine by some request
  # and carries real expert ids; the last sampled token (and the <|im_end|> that may close a cut
  # reply) never were.
  assert seg.routes.dtype == np.uint16
  assert seg.routes.shape == (n, cfg.num_moe_layers, cfg.experts_per_token)
  last = int(np.flatnonzero(mask)[-1])
  assert (seg.routes[:last] < cfg.num_routed_experts).all()
  assert (seg.routes[last:] == UNRECORDED).all()
  assert len(np.unique(seg.routes[:last])) > 1  # not one constant


def test_rollouts_come_back_consistent_and_a_seed_repeats_them(backend, rl_world):
  tasks = rl_world.tasks[:2]
  specs = [RolloutSpec(0, i, task.task_id, seed=11 + i) for i, task in enumerate(tasks)]
  futures = [backend.submit(spec, task) for spec, task in zip(specs, tasks)]
  rollouts = [f.result(timeout=TIMEOUT) for f in futures]
  version = backend.engine_version()
  for spec, task, rollout in zip(specs, tasks, rollouts):
    check_rollout(rollout, spec, generation_prompt(backend, task), rl_world, version)

  # The same spec again (alone in the engine this time): the same ids, the same log-probs.
  again = backend.submit(specs[0], tasks[0]).result(timeout=TIMEOUT)
  assert [s.tokens for s in again.segments] == [s.tokens for s in rollouts[0].segments]
  np.testing.assert_allclose(again.segments[0].sampler_logp, rollouts[0].segments[0].sampler_logp,
                             atol=1e-5)
  np.testing.assert_array_equal(again.segments[0].routes, rollouts[0].segments[0].routes)
  # Another seed samples something else.
  other = rollout_of(backend, tasks[0], seed=12345)
  prompt = len(generation_prompt(backend, tasks[0]))
  assert other.segments[0].tokens[prompt:] != rollouts[0].segments[0].tokens[prompt:]
  # At most two rollouts at once so far, at least one whenever the engine decoded.
  slots = backend.spec.engine_slots
  assert 1 / slots <= backend.stats()["engine/decode_occupancy"] <= 2 / slots


def test_load_version_swaps_the_weights_the_engine_samples_with(backend, rl_world):
  task = rl_world.tasks[0]
  before = rollout_of(backend, task, seed=7)
  assert before.min_version == before.max_version == 0
  rng = np.random.default_rng(1)
  perturbed = jax.tree_util.tree_map(
      lambda x: x + 0.5 * rng.normal(size=x.shape).astype(x.dtype)
      if np.issubdtype(x.dtype, np.floating) else x, rl_world.params)
  publication.WeightStore(backend.spec.store_dir).publish(1, perturbed)

  backend.load_version(1)
  deadline = time.time() + 60
  while backend.engine_version() != 1:  # the engine is idle: nothing else makes it step
    assert time.time() < deadline, "the engine never reported version 1"
    time.sleep(0.05)
  after = rollout_of(backend, task, seed=7)
  assert after.min_version == after.max_version == 1
  prompt = generation_prompt(backend, task)
  check_rollout(after, RolloutSpec(0, 0, task.task_id, 7), prompt, rl_world, 1)
  # New weights, same seed: other log-probs (and, almost surely, other ids).
  n = min(len(before.segments[0].tokens), len(after.segments[0].tokens))
  assert not np.allclose(before.segments[0].sampler_logp[:n], after.segments[0].sampler_logp[:n])
  assert backend.stats()["engine/version"] == 1


def test_a_dead_engine_fails_its_rollouts_and_a_replacement_serves_the_next(backend, rl_world,
                                                                            monkeypatch):
  host = backend._current_engine()  # pylint: disable=protected-access
  gate = EngineGate(monkeypatch, backend, ["g7-s0-t0", "g7-s1-t0"], release=host.dead)
  tasks = rl_world.tasks[:2]
  futures = [backend.submit(RolloutSpec(7, i, task.task_id, seed=i), task)
             for i, task in enumerate(tasks)]
  assert gate.held.wait(TIMEOUT)  # both first requests are inside the engine
  backend.kill_engine()
  for future in futures:
    with pytest.raises(WorkerDiedError):
      future.result(timeout=TIMEOUT)

  version = backend.engine_version()
  rollout = rollout_of(backend, tasks[0], group=7, index=2, seed=3)
  assert backend._engine is not host  # pylint: disable=protected-access
  assert rollout.sampled_tokens > 0 and rollout.min_version == rollout.max_version == version
  stats = backend.stats()
  assert stats["workers/engine_restarts"] == 1 and stats["workers/env_restarts"] == 0


def test_a_dead_environment_worker_fails_only_its_rollout(backend, rl_world, monkeypatch):
  gate = EngineGate(monkeypatch, backend, ["g8-s0-t0"])
  tasks = rl_world.tasks[:3]
  restarts = backend.stats()["workers/env_restarts"]
  futures = [backend.submit(RolloutSpec(8, i, task.task_id, seed=i), task)
             for i, task in enumerate(tasks)]
  try:
    assert gate.held.wait(TIMEOUT)  # the first rollout's request is inside the engine
    backend.kill_env_worker()
  finally:
    gate.release.set()
  with pytest.raises(WorkerDiedError):
    futures[0].result(timeout=TIMEOUT)
  for i, future in enumerate(futures[1:], 1):
    rollout = future.result(timeout=TIMEOUT)
    assert rollout.spec.index == i and rollout.sampled_tokens > 0
  assert backend.stats()["workers/env_restarts"] == restarts + 1
  # The pool is whole again: the next rollout runs.
  assert rollout_of(backend, tasks[0], group=8, index=3).sampled_tokens > 0


@pytest.mark.slow  # a second engine compile (the speculative step)
def test_rollouts_with_mtp_speculative_decoding_report_acceptance(rl_world):
  """Rollouts drafted by the MTP module (rl.draft_depth) keep the rollout contract, and the
  engine reports per-depth acceptance for TensorBoard (engine/mtp_acceptance_<d>)."""
  spec = dataclasses.replace(rl_world.spec, draft_depth=1)
  host = workers.EngineHost(spec, 0)
  try:
    task = rl_world.tasks[0]
    rollout = workers.run_task(spec, RolloutSpec(0, 0, task.task_id, 1), task, host.generate)
    segment = rollout.segments[0]
    sampled = [lp for lp, m in zip(segment.sampler_logp, segment.model_mask) if m]
    assert sampled and all(np.isfinite(lp) and lp <= 0 for lp in sampled)
    acceptance = host.stats()["engine/mtp_acceptance_1"]
    assert 0.0 <= acceptance <= 1.0
  finally:
    host.close()
