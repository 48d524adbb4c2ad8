"""The RL learner end to end on the small model (random weights: rewards are ~0, which is fine
here; the tiny pipeline's learning is measured by experiments/rl.py:tiny, README).

  faults + resume      an engine worker and an environment worker killed mid-run; the run
                       finishes, every started group is accounted for, none trained twice;
                       a second invocation resumes from the checkpoint and continues
  synchronous = async  with rl.max_staleness=0 the asynchronous learner reproduces a plain
                       synchronous loop (generate with version s, train, publish) exactly
  SIGTERM              saves learner and coordinator state and exits; the rerun resumes; when
                       it comes while the learner waits for rollouts, it saves at once
"""
import json
import os
import signal
import time

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from c2 import config as config_lib
from c2.cli import load_experiment

pytestmark = pytest.mark.slow


def small_rl_experiment(small_model, tokenizer_path, **rl):
  c = load_experiment("experiments/rl.py", "tiny")
  c.model.update(small_model)
  c.data.update(seq_len=1024, global_batch_size=8, tokenizer=str(tokenizer_path))
  c.env.max_turns = 3
  c.rl.update(group_size=2, groups_per_step=2, max_new_tokens=24, heldout_tasks=2,
              eval_samples=1, eval_every=100, env_workers=4, engine_slots=4, max_retries=3,
              publish_dtype="float32", kl_coef=0.0,  # tests that need the KL pass it
              drop_uniform_groups="off")  # exact group counts; tests/rl/test_coordinator.py
  c.rl.update(**rl)
  c.train.update(steps=4)
  c.checkpoint.update(every_steps=2)
  return config_lib.from_config_dict(c)


def _trained_ids(workdir):
  from c2.train import checkpoint as ckpt_lib
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "ckpt"), async_save=False)
  step = checkpointer.latest_step()
  with open(os.path.join(workdir, "ckpt", str(step), "meta", "metadata")) as f:
    return step, json.load(f)["data_state"]["trained"]


def test_faults_and_resume_lose_no_group_and_train_none_twice(small_model, tokenizer_512, tmp_path):
  from c2.rl import learner
  # The k1 KL to the start checkpoint is on, so the reference policy is rebuilt on the resume.
  exp = small_rl_experiment(small_model, tokenizer_512, kl_coef=0.01)
  workdir = str(tmp_path / "run")
  killed = []

  def inject(run, step):
    if step == 1:  # groups for steps 1 and 2 are in flight now (max_staleness=1)
      run.backend.kill_engine()
      run.backend.kill_env_worker()
      killed.append(step)

  first = learner.run(exp, workdir, max_steps=2, on_step=inject)
  assert killed == [1]
  assert first["workers/engine_restarts"] == 1
  a = {k[len("accounting/"):]: v for k, v in first.items() if k.startswith("accounting/")}
  assert a["started"] == (a["trained"] + a["dropped_stale"] + a["dropped_failed"]
                          + a["dropped_uniform"] + a["ready"] + a["in_flight"])
  assert a["trained"] == 4 and a["dropped_failed"] == 0
  step, trained_first = _trained_ids(workdir)
  assert step == 2 and len(trained_first) == 4

  second = learner.run(exp, workdir)  # resumes at step 2, trains steps 2 and 3
  step, trained = _trained_ids(workdir)
  assert step == 4
  assert len(trained) == len(set(trained)) == 8
  assert set(trained_first) < set(trained)
  assert second["rl/staleness_max"] <= 1
  tb = event_accumulator.EventAccumulator(os.path.join(workdir, "tb"))
  tb.Reload()
  tags = set(tb.Tags()["scalars"])
  for tag in ("reward/mean", "rollout/pass_rate", "rl/staleness_max", "train/rl/mismatch_p99",
              "train/rl/replay_override_rate", "engine/tokens_per_sec", "engine/decode_occupancy",
              "perf/wait_fraction", "perf/learner_step_sec", "eval/pass_rate", "eval/pass_at_1",
              "rollout/turns_mean", "rollout/tool_calls_mean", "rollout/summaries_mean",
              "train/rl/kl", "eval/pass_rate_change", "eval/pass_rate_change_ci_low"):
    assert tag in tags, tag
  assert any(tag.startswith("eval/pass_rate/") for tag in tags), sorted(tags)  # per task kind
  assert [e.step for e in tb.Scalars("reward/mean")] == [1, 2, 3, 4]


def _params_after(exp, workdir, steps):
  from c2.rl import learner
  learner.run(exp, workdir, max_steps=steps)
  from c2.rl import publication
  return publication.WeightStore(os.path.join(workdir, "weights")).load(steps)


def test_staleness_zero_reproduces_the_synchronous_loop(small_model, tokenizer_512, tmp_path):
  """The async learner with max_staleness=0 against a synchronous loop built from the same parts:
  roll out the step's groups with the engine at version s, wait, train, publish, repeat."""
  from c2.rl import learner, metrics as rl_metrics
  from c2.rl.coordinator import Group, rollout_seed
  from c2.rl.rollout import RolloutSpec

  exp = small_rl_experiment(small_model, tokenizer_512, max_staleness=0, heldout_tasks=0)
  asynchronous = _params_after(exp, str(tmp_path / "async"), 2)

  run = learner.prepare(exp, str(tmp_path / "sync"))
  rl, gid = exp.rl, 0
  tasks = learner.load_tasks(exp, "train", 8)
  try:
    for step in range(2):
      groups = []
      for _ in range(rl.groups_per_step):
        task = tasks[gid]
        futures = [run.backend.submit(RolloutSpec(gid, i, task.task_id,
                                                  rollout_seed(exp.data.seed, gid, i)), task)
                   for i in range(rl.group_size)]
        groups.append(Group(gid, task, step, [f.result() for f in futures], [1] * rl.group_size))
        gid += 1
      assert all(g.min_version == step for g in groups)
      learner.train_step(run, step, groups)
      run.store.publish(step + 1, jax.device_get(run.state.params))
      run.backend.load_version(step + 1)
      while run.backend.engine_version() < step + 1:
        pass
    synchronous = run.store.load(2)
  finally:
    run.publisher.close()
    run.backend.close()
    run.coordinator.close()
  flat_a = jax.tree.leaves(asynchronous)
  flat_s = jax.tree.leaves(synchronous)
  assert len(flat_a) == len(flat_s)
  for a, s in zip(flat_a, flat_s):
    np.testing.assert_array_equal(a, s)
  del rl_metrics


def test_sigterm_saves_and_the_rerun_resumes(small_model, tokenizer_512, tmp_path):
  from c2.rl import learner
  exp = small_rl_experiment(small_model, tokenizer_512, heldout_tasks=0)
  workdir = str(tmp_path / "run")

  def preempt(run, step):
    if step == 1:
      # A SIGTERM during a wait for rollouts saves at once (the next test); this one comes
      # when step 1's batch is ready, so that step is trained before the save.
      deadline = time.time() + 300
      while not _batch_ready(run.coordinator, 1):
        assert time.time() < deadline, run.coordinator.accounting()
        time.sleep(0.05)
      os.kill(os.getpid(), signal.SIGTERM)

  learner.run(exp, workdir, on_step=preempt)
  step, trained = _trained_ids(workdir)
  assert step == 2 and len(trained) == 4  # the step in progress finished, then it saved
  learner.run(exp, workdir)
  step, trained = _trained_ids(workdir)
  assert step == 4 and len(set(trained)) == 8


def _batch_ready(coordinator, step):
  with coordinator._lock:  # pylint: disable=protected-access
    ready = [coordinator._groups[i] for i in coordinator._ready]  # pylint: disable=protected-access
    return sum(g.target_step <= step for g in ready) >= coordinator.groups_per_step


def test_sigterm_while_waiting_for_rollouts_saves_at_once_and_the_rerun_resumes(
    small_model, tokenizer_512, tmp_path):
  from c2.rl import learner
  exp = small_rl_experiment(small_model, tokenizer_512, heldout_tasks=0)
  workdir = str(tmp_path / "run")
  waited = []

  def preempt(run, step):
    if step == 1:  # step 1's rollouts take longer than the grace period: the wait is cut short
      def slow_rollouts(step, should_stop=None):
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 60
        while not should_stop():
          assert time.time() < deadline, "SIGTERM did not reach next_batch's should_stop"
          time.sleep(0.01)
        waited.append(step)
        return None
      run.coordinator.next_batch = slow_rollouts

  learner.run(exp, workdir, on_step=preempt)
  assert waited == [1]
  step, trained = _trained_ids(workdir)
  assert step == 1 and len(trained) == 2  # saved before step 1, not after it
  learner.run(exp, workdir)
  step, trained = _trained_ids(workdir)
  assert step == 4 and len(set(trained)) == len(trained) == 8
