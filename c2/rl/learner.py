"""The RL phase's root: `python -m c2.main --config experiments/rl.py:tiny --workdir DIR` lands
here. The only part of c2/rl that sees the experiment config.

  prepare:  mesh -> tokenizer -> program (the RL step of c2/steps/rl.py, jitted with shardings)
            -> init (from train.init_from, the SFT checkpoint) or resume -> weight store ->
            backend (engines + environment workers) -> coordinator
  loop:     next batch of graded groups (waiting is timed) -> advantages -> global packing ->
            [reference log-probs] -> rl_step -> publish version step + 1 (asynchronous) ->
            metrics; held-out pass rate every rl.eval_every steps; checkpoints (learner state +
            coordinator state) on schedule, on SIGTERM and at the end.

Resuming: rerunning the command restores the latest checkpoint and the coordinator's state from
its metadata; versions published after that checkpoint are forgotten (they are published again);
ready groups on disk are used as they are, groups in flight are rolled out again. Staleness
(policy version lag of every trained token) is asserted to stay within rl.max_staleness, and at
the end every started group is accounted for (trained, dropped stale, dropped failed, dropped
as uniform under rl.drop_uniform_groups, or left over ready / in flight).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import pickle
import time
from typing import Callable, Optional

import jax
import numpy as np

from c2.config import ExperimentConfig
from c2.data import loader
from c2.envs import config as env_config_lib
from c2.envs import task_generator
from c2.envs.tasks import read_jsonl
from c2.evals import passk
from c2.infer.sampling import SamplingParams
from c2.rl import metrics as rl_metrics
from c2.rl import publication
from c2.rl.backends import Backend, make_backend
from c2.rl.coordinator import Coordinator
from c2.rl.curriculum import Curriculum, parse_weights as parse_curriculum_weights
from c2.rl.packing import pack_rl_batch
from c2.rl.rollout import RolloutSpec
from c2.rl.workers import WorkerSpec
from c2.train import checkpoint as ckpt_lib
from c2.train import loop as train_loop
from c2.train import program as program_lib
from c2.train.metrics import MetricWriter


class StalenessError(AssertionError):
  pass


@dataclasses.dataclass
class Learner:
  exp: ExperimentConfig
  workdir: str
  program: program_lib.Program
  state: object
  reference_params: Optional[dict]
  store: publication.WeightStore
  publisher: publication.AsyncPublisher
  backend: Backend
  coordinator: Coordinator
  checkpointer: ckpt_lib.Checkpointer
  heldout: list
  writer: MetricWriter
  leftover: list = dataclasses.field(default_factory=list)


# Sequences of trained groups that did not fit the last batch wait in `Learner.leftover`; the
# coordinator already counts their groups trained, so they are saved with each checkpoint (one
# file per checkpointed step, written before it) and a resume trains them: no group is half lost.
def save_leftover(directory: str, step: int, sequences: list) -> None:
  os.makedirs(directory, exist_ok=True)
  publication.write_atomic(os.path.join(directory, f"leftover-{step:09d}.pkl"),
                           pickle.dumps(sequences))


def load_leftover(directory: str, step: int) -> list:
  """The sequences saved with the checkpoint of `step` ([] when it had none)."""
  path = os.path.join(directory, f"leftover-{step:09d}.pkl")
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    return pickle.load(f)


def prune_leftover(directory: str, keep_steps) -> None:
  """Deletes the files of steps no retained checkpoint has."""
  keep = {f"leftover-{s:09d}.pkl" for s in keep_steps}
  for name in os.listdir(directory) if os.path.isdir(directory) else []:
    if name.startswith("leftover-") and name not in keep:
      os.remove(os.path.join(directory, name))


def load_tasks(exp: ExperimentConfig, split: str, count: int) -> list:
  rl = exp.rl
  if rl.tasks.startswith("jsonl:"):
    path = rl.tasks[len("jsonl:"):].format(split=split)
    return read_jsonl(path)[:count]
  levels = tuple(int(v) for v in rl.task_levels.split(","))
  return task_generator.generate(exp.data.seed, count, split=split, levels=levels)


def worker_spec(exp: ExperimentConfig, workdir: str, tokenizer_path: str) -> WorkerSpec:
  rl = exp.rl
  env = env_config_lib.to_env_config(exp.env) if exp.env is not None else (
      env_config_lib.to_env_config(env_config_lib.env_section()))
  sampling = SamplingParams(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                            top_p=rl.top_p)
  model = exp.model.replace(dtype=rl.engine_dtype) if rl.engine_dtype else exp.model
  return WorkerSpec(model=model, store_dir=os.path.join(workdir, "weights"),
                    tokenizer_path=tokenizer_path, env=env, sampling=sampling,
                    max_context=rl.max_context or exp.data.seq_len,
                    engine_slots=rl.engine_slots, draft_depth=rl.draft_depth,
                    prefix_cache=rl.prefix_cache, decode_steps=rl.decode_steps)


def _tokenizer_path(exp: ExperimentConfig, workdir: str) -> str:
  train_loop.make_tokenizer(exp, workdir)  # checks the vocabulary; caches "default" in workdir
  if exp.data.tokenizer == "default":
    return os.path.join(workdir, "tokenizer.json")
  return exp.data.tokenizer


def prepare(exp: ExperimentConfig, workdir: str) -> Learner:
  os.makedirs(workdir, exist_ok=True)
  mesh = train_loop.make_mesh(exp)
  tokenizer_path = _tokenizer_path(exp, workdir)
  program = program_lib.build(exp, mesh)
  train_loop.report_shardings(program)
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "ckpt"), keep=exp.checkpoint.keep,
                                       async_save=False)
  resumed = checkpointer.latest_step() is not None
  meta = {}
  if resumed:
    with program.context():
      state, meta = checkpointer.restore(program.abstract_state)
    print(f"resumed from {checkpointer.directory} at step {int(state.step)}", flush=True)
  else:
    state = program.init_state(exp.train.seed)
    if exp.train.init_from:
      state = train_loop._load_init_from(exp, program, state)  # pylint: disable=protected-access
    else:
      print("train.init_from is not set: RL starts from random weights", flush=True)
  step = int(jax.device_get(state.step))
  reference = None
  if program.reference_logp is not None and not resumed:  # the RL start checkpoint
    reference = jax.tree.map(lambda x: x.copy(), state.params)
  elif program.reference_logp is not None:  # resumed: rebuild the start point the same way
    reference_state = program.init_state(exp.train.seed)
    if exp.train.init_from:
      reference_state = train_loop._load_init_from(exp, program, reference_state)  # pylint: disable=protected-access
    reference = reference_state.params
  rl = exp.rl
  store = publication.WeightStore(os.path.join(workdir, "weights"),
                                  snapshot_every=rl.snapshot_every, dtype=rl.publish_dtype)
  store.truncate_after(step - 1)  # versions after the checkpoint are published again
  store.publish(step, jax.device_get(state.params))
  spec = worker_spec(exp, workdir, tokenizer_path)
  backend = make_backend(rl.backend, spec, env_workers=rl.env_workers, engines=rl.engines)
  backend.start(step)
  # Each task is used once; dropping uniform groups uses an unknown multiple of them.
  needed = rl.train_tasks if rl.drop_uniform_groups != "off" else min(
      rl.train_tasks, exp.train.steps * rl.groups_per_step * 2 + 8)
  train_tasks = load_tasks(exp, "train", needed)
  curriculum = Curriculum(start_group=rl.curriculum_start_group, window=rl.curriculum_window,
                          weights=parse_curriculum_weights(rl.curriculum_weights),
                          temperature=rl.curriculum_temperature, floor=rl.curriculum_floor)
  coordinator = Coordinator(
      backend, train_tasks, group_size=rl.group_size, groups_per_step=rl.groups_per_step,
      max_staleness=rl.max_staleness, state_dir=os.path.join(workdir, "rl"),
      latest_published=store.latest_version, total_steps=exp.train.steps,
      max_retries=rl.max_retries, max_failed_groups_in_a_row=rl.max_failed_groups_in_a_row,
      seed=exp.data.seed, curriculum=curriculum,
      drop_uniform_groups=rl.drop_uniform_groups)
  if meta.get("data_state"):
    coordinator.load_state_dict(meta["data_state"])
  heldout = load_tasks(exp, "heldout", rl.heldout_tasks) if rl.heldout_tasks else []
  writer = MetricWriter(os.path.join(workdir, "tb"), enabled=jax.process_index() == 0)
  if not resumed:
    writer.write_config(dataclasses.asdict(exp), {"rl/group_size": rl.group_size})
  leftover = load_leftover(os.path.join(workdir, "rl"), step) if resumed else []
  return Learner(exp, workdir, program, state, reference, store,
                 publication.AsyncPublisher(store), backend, coordinator, checkpointer, heldout,
                 writer, leftover)


# ------------------------------------------------------------------------------------- steps


def evaluate(learner: Learner, version: int, timeout: float = 3600.0) -> dict:
  """Held-out pass rate at `version`: rl.eval_samples rollouts per held-out task, once the
  engines sample with that version. Training rollouts keep running alongside."""
  deadline = time.time() + timeout
  while learner.backend.engine_version() < version:
    learner.coordinator.pump()
    if time.time() > deadline:
      raise TimeoutError(f"engines did not reach version {version} for the evaluation")
    time.sleep(0.05)
  futures = []
  for i, task in enumerate(learner.heldout):
    for k in range(learner.exp.rl.eval_samples):
      spec = RolloutSpec(-(i + 1), k, task.task_id, seed=10_007 * (i + 1) + k)
      futures.append((task, learner.backend.submit(spec, task)))
  results, by_kind = [], []
  for task, future in futures:
    try:
      passed = future.result(timeout=max(deadline - time.time(), 1.0)).passed
    except Exception:  # pylint: disable=broad-except
      passed = False  # an eval rollout that dies counts as a failure
    results.append((task.task_id, passed))
    by_kind.append((task.kind, passed))
  out = {f"eval/{k}": v for k, v in rl_metrics.pass_rate(results).items()}
  out.update({f"eval/{k}": v for k, v in rl_metrics.pass_rate_by_kind(by_kind).items()})
  # Per-task rates kept beside the checkpoints (they survive a resume), so every later evaluation
  # states its change against the start, paired over the same tasks.
  per_task = rl_metrics.per_task_pass_rates(results)
  directory = os.path.join(learner.workdir, "rl")
  os.makedirs(directory, exist_ok=True)
  publication.write_atomic(os.path.join(directory, f"heldout-pass-{version:09d}.json"),
                           json.dumps(per_task).encode())
  start_path = os.path.join(directory, f"heldout-pass-{0:09d}.json")
  if version > 0 and os.path.exists(start_path):
    with open(start_path) as f:
      out.update({f"eval/{k}": v for k, v in rl_metrics.pass_rate_change(
          json.load(f), per_task).items()})
  # Best-of-K beside the mean (report section 4.10): unbiased pass@k over the task's samples.
  passed = collections.defaultdict(list)
  for task_id, ok in results:
    passed[task_id].append(ok)
  samples = learner.exp.rl.eval_samples
  out.update({f"eval/pass_at_{k}": v for k, v in passk.pass_at_k_over_tasks(
      [(len(v), sum(v)) for v in passed.values()], range(1, samples + 1)).items()})
  return out


def _check_staleness(groups, step: int, bound: int) -> None:
  for group in groups:
    lag = step - group.min_version
    if lag > bound:
      raise StalenessError(f"group {group.group_id} trained at step {step} with tokens of "
                           f"version {group.min_version}: lag {lag} > rl.max_staleness={bound}")


def train_step(learner: Learner, step: int, groups) -> tuple[dict, object]:
  """One learner update on `groups`; returns (host metrics, the packed batch)."""
  exp, program = learner.exp, learner.program
  sequences = learner.leftover + rl_metrics.train_sequences(groups)
  b, t = exp.data.global_batch_size, exp.data.seq_len
  sizes = exp.validate_for_devices(jax.device_count())
  shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  with_routes = "forced_routes" in program.abstract_batch
  batch, stats, learner.leftover = pack_rl_batch(
      sequences, rows=b, row_len=t, shards=shards, attention_weight=exp.rl.attention_weight,
      with_routes=with_routes, moe_layers=exp.model.num_moe_layers,
      top_k=exp.model.experts_per_token)
  with program.context():
    batch = loader.to_global(batch, program.mesh)
    if program.reference_logp is not None:
      batch["ref_logp"] = program.reference_logp(learner.reference_params, batch)
    learner.state, metrics = program.train_step(learner.state, batch)
  metrics = {f"train/{k}": float(v) for k, v in jax.device_get(metrics).items()}
  metrics.update(stats.metrics())
  return metrics, batch


def run(exp: ExperimentConfig, workdir: str, *, max_steps: Optional[int] = None,
        on_step: Optional[Callable[[Learner, int], None]] = None) -> dict:
  """Trains until exp.train.steps (or max_steps); returns the last metrics. `on_step(learner,
  step)` runs before each step (the fault tests kill workers from it)."""
  learner = prepare(exp, workdir)
  rl = exp.rl
  step = int(jax.device_get(learner.state.step))
  last_step = min(exp.train.steps, max_steps or exp.train.steps)
  learner.coordinator.start(step)
  metrics: dict = {}
  started = time.time()
  try:
    if step == 0 and learner.heldout:
      first = evaluate(learner, 0)
      learner.writer.write_scalars(0, first)
      print(f"step 0: held-out pass rate {_format_rate(first)}", flush=True)
    with train_loop.Preemption() as preemption:
      while step < last_step:
        if on_step is not None:
          on_step(learner, step)
        wait_start = time.time()
        groups = learner.coordinator.next_batch(step, should_stop=lambda: preemption.requested)
        if groups is None:  # SIGTERM while waiting for rollouts: save now, not after them
          if step not in learner.checkpointer.all_steps():
            save(learner)
          print(f"SIGTERM while waiting for rollouts: saved step {step}, exiting", flush=True)
          break
        waited = time.time() - wait_start
        _check_staleness(groups, step, rl.max_staleness)
        step_start = time.time()
        metrics, _ = train_step(learner, step, groups)
        learner.publisher.publish(step + 1, learner.state.params)
        step_seconds = time.time() - step_start
        step += 1
        metrics.update(rl_metrics.rollout_metrics(groups, step - 1))
        metrics.update(rl_metrics.sampled_metrics(learner.coordinator.drain_rollout_log()))
        metrics.update(learner.backend.stats())
        metrics.update({f"coordinator/{k}": float(v)
                        for k, v in learner.coordinator.accounting().items()})
        metrics.update({"perf/learner_step_sec": step_seconds, "perf/wait_sec": waited,
                        "perf/wait_fraction": waited / max(waited + step_seconds, 1e-9)})
        out_of_time = (exp.train.max_minutes is not None
                       and time.time() - started > 60 * exp.train.max_minutes)
        stop = preemption.requested or out_of_time or step == last_step
        if learner.heldout and (step % rl.eval_every == 0 or step == last_step):
          learner.publisher.wait()
          metrics.update(evaluate(learner, step))
          print(f"step {step}: held-out pass rate {_format_rate(metrics)}", flush=True)
        if step % exp.train.log_every == 0 or stop:
          learner.writer.write_scalars(step, metrics)
          print(f"step {step}: reward {metrics.get('reward/mean', float('nan')):.3f} "
                f"pass {metrics.get('rollout/pass_rate', float('nan')):.2f} "
                f"(all sampled {metrics.get('sampled/pass_rate', float('nan')):.2f}) "
                f"staleness<= {metrics.get('rl/staleness_max', 0):.0f} "
                f"wait {metrics['perf/wait_fraction']:.0%}", flush=True)
        if step % exp.checkpoint.every_steps == 0 or stop:
          save(learner)
        if stop:
          if preemption.requested:
            print(f"SIGTERM: saved step {step}, exiting", flush=True)
          break
  finally:
    learner.coordinator.close()
    learner.publisher.close()
    learner.backend.close()
    learner.writer.close()
  accounting = learner.coordinator.accounting()
  print(f"groups: {accounting}\nweights: {learner.store.delta_stats()}\n"
        f"TensorBoard logs: {os.path.join(workdir, 'tb')}\n"
        f"Open the curves:  tensorboard --logdir {os.path.join(workdir, 'tb')}", flush=True)
  return {**metrics, **{f"accounting/{k}": v for k, v in accounting.items()}}


def save(learner: Learner) -> None:
  """Learner state + coordinator state in one checkpoint (leftover sequences beside it); then the
  trained groups' files go."""
  rl_dir = os.path.join(learner.workdir, "rl")
  save_leftover(rl_dir, int(jax.device_get(learner.state.step)), learner.leftover)
  learner.checkpointer.save(learner.state, data_state=learner.coordinator.state_dict(),
                            force=True)
  learner.checkpointer.wait()
  prune_leftover(rl_dir, learner.checkpointer.all_steps())
  learner.coordinator.forget_trained()


def _format_rate(m: dict) -> str:
  text = (f"{m.get('eval/pass_rate', float('nan')):.3f} (95% CI "
          f"{m.get('eval/pass_rate_ci_low', float('nan')):.3f} to "
          f"{m.get('eval/pass_rate_ci_high', float('nan')):.3f}, "
          f"{m.get('eval/rollouts', 0):.0f} rollouts)")
  if "eval/pass_rate_change" in m:
    text += (f"; change since step 0 {m['eval/pass_rate_change']:+.3f} (paired 95% CI "
             f"{m['eval/pass_rate_change_ci_low']:+.3f} to "
             f"{m['eval/pass_rate_change_ci_high']:+.3f})")
  return text
