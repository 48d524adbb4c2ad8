"""The training loop, top to bottom in named phases: mesh -> data -> program (abstract state,
shardings, jitted steps) -> init or restore -> loop. The only side-effecting part of c2;
everything it calls is pure or a small object with one job (Checkpointer, MetricWriter).

Safety rails, all on: automatic resume from workdir/ckpt (model, optimizer and data-iterator
state, so a resumed run continues with exactly the next batch); save on SIGTERM (preemption), on
the time budget and at the end; the step loop runs under jax.transfer_guard("disallow"), so every
host<->device copy in it is an explicit device_put / device_get; a non-finite loss stops the run
naming the step window, any other non-finite metric is logged by name; the sharding report is
printed by process 0, which alone writes metrics and config.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any, Iterator, Optional

import jax
import numpy as np
import optax
import tqdm

from c2.config import ExperimentConfig
from c2.data import corpus_stats, loader
from c2.data.tokenizer import Tokenizer, load_tokenizer
from c2.parallel import mesh as meshlib
from c2.parallel import report as sharding_report
from c2.parallel.sharding import with_shardings
from c2.perf import flops, hardware
from c2.train import checkpoint as ckpt_lib
from c2.train import program as program_lib
from c2.train.metrics import MetricWriter
from c2.train.state import TrainState


class NonFiniteLossError(RuntimeError):
  pass


class Preemption:
  """Turns SIGTERM into a flag the loop checks, so the run saves before it exits."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread (e.g. some test runners): no handler
      self._previous = None
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


@dataclasses.dataclass
class Run:
  """Everything the loop needs, built by `prepare`."""
  exp: ExperimentConfig
  workdir: str
  program: program_lib.Program
  tokenizer: Tokenizer
  train_iter: Any  # c2.data.loader iterator with get_state / set_state
  checkpointer: ckpt_lib.Checkpointer
  state: TrainState
  is_primary: bool


# ----------------------------------------------------------------------------------- phases


def make_mesh(exp: ExperimentConfig) -> jax.sharding.Mesh:
  mesh = meshlib.make_mesh(exp.validate_for_devices(jax.device_count()),
                           num_slices=exp.mesh.num_slices)
  if jax.process_index() == 0:
    print(f"mesh {dict(mesh.shape)} on {jax.device_count()} devices "
          f"({jax.process_count()} processes)", flush=True)
  return mesh


def make_tokenizer(exp: ExperimentConfig, workdir: str) -> Tokenizer:
  tokenizer = load_tokenizer(exp.data.tokenizer, cache_dir=workdir,
                             default_vocab_size=exp.data.tokenizer_vocab_size)
  if tokenizer.vocab_size > exp.model.vocab_size:
    raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but config.model.vocab_size is "
                     f"{exp.model.vocab_size}; raise model.vocab_size or shrink the tokenizer")
  return tokenizer


def make_iterator(exp: ExperimentConfig, tokenizer: Tokenizer, split: str) -> Iterator:
  """The train split (read once per epoch, resumable) or the held-out split (the same batches
  from the start every time it is made)."""
  d = exp.data
  # Zig-zag rows under latent context parallelism (c2/data/zigzag.py), for the mesh's context.
  context = meshlib.resolve_axis_sizes(exp.mesh.axis_sizes(), jax.device_count())["context"]
  transform = program_lib.batch_transform(exp, context)
  if split == "train":
    return loader.make_iterator(
        phase=exp.phase, source=d.source, tokenizer=tokenizer, seq_len=d.seq_len,
        global_batch_size=d.global_batch_size, seed=d.seed, split="train",
        text_field=d.text_field, sft_train_on=d.sft_train_on, read_threads=d.read_threads,
        num_workers=d.num_workers, min_doc_tokens=d.min_doc_tokens,
        repeat_fraction=d.repeat_fraction, copy_drill_span=d.copy_drill_span,
        batch_transform=transform)
  return loader.make_iterator(
      phase=exp.phase, source=d.eval_source or d.source, tokenizer=tokenizer, seq_len=d.seq_len,
      global_batch_size=d.global_batch_size, seed=d.seed, split="heldout", num_epochs=None,
      min_doc_tokens=d.min_doc_tokens, batch_transform=transform)


def report_shardings(program: program_lib.Program) -> None:
  """Prints every parameter's spec and bytes per device (process 0); fails on replication."""
  rows = sharding_report.report(program.abstract_state.params, program.state_shardings.params)
  if jax.process_index() == 0:
    print("parameters:\n" + sharding_report.format_report(rows), flush=True)
  sharding_report.check_replication(rows, program.mesh.size)


def init_or_restore(exp: ExperimentConfig, program: program_lib.Program,
                    checkpointer: ckpt_lib.Checkpointer, train_iter) -> TrainState:
  """The latest checkpoint in the workdir (with the data iterator's position), else fresh
  params, optionally loaded from `train.init_from`."""
  if checkpointer.latest_step() is None:
    state = program.init_state(exp.train.seed)
    return _load_init_from(exp, program, state) if exp.train.init_from else state
  with program.context():
    state, meta = checkpointer.restore(program.abstract_state)
  if meta.get("data_state") is not None:
    train_iter.set_state(meta["data_state"])
  print(f"resumed from {checkpointer.directory} at step {int(state.step)}", flush=True)
  return state


def _load_init_from(exp: ExperimentConfig, program: program_lib.Program,
                    state: TrainState) -> TrainState:
  """Params from another run's checkpoint; modules it lacks (e.g. new MTP heads) stay fresh."""
  abstract_params = with_shardings(state.params, program.state_shardings.params)
  restored, missing = ckpt_lib.restore_params_subset(exp.train.init_from, abstract_params)
  params = {**state.params, **restored}
  print(f"init_from {exp.train.init_from}: restored {sorted(restored)}; freshly initialised "
        f"{missing}", flush=True)
  if exp.train.init_from_optimizer:
    if missing:
      raise ValueError(f"config.train.init_from_optimizer: {exp.train.init_from} lacks the "
                       f"modules {missing}, so it has no optimizer state for them; set "
                       "init_from_optimizer=False or give a checkpoint with the same modules")
    with program.context():
      opt_state = ckpt_lib.restore_opt_state(exp.train.init_from,
                                             program.abstract_state.opt_state)
    print(f"init_from {exp.train.init_from}: optimizer state restored (moments kept; the "
          "learning-rate schedule starts at this run's step 0)", flush=True)
    return state.replace(params=params, opt_state=restart_schedules(opt_state))
  init_opt = jax.jit(program.optimizer.tx.init, out_shardings=program.state_shardings.opt_state)
  with program.context():
    return state.replace(params=params, opt_state=init_opt(params))


def restart_schedules(opt_state):
  """The optimizer state with every learning-rate schedule's position set back to 0: a new
  phase runs its own schedule, while Adam's moments and bias-correction count carry over."""
  def reset(node):
    if isinstance(node, optax.ScaleByScheduleState):
      zero = np.zeros(node.count.shape, node.count.dtype)
      return node._replace(count=jax.device_put(zero, node.count.sharding))
    return node
  return jax.tree.map(reset, opt_state,
                      is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState))


def prepare(exp: ExperimentConfig, workdir: str) -> Run:
  """mesh -> tokenizer and data -> program -> sharding report -> init or restore."""
  if "://" not in workdir:
    os.makedirs(workdir, exist_ok=True)
  mesh = make_mesh(exp)
  tokenizer = make_tokenizer(exp, workdir)
  train_iter = make_iterator(exp, tokenizer, "train")
  program = program_lib.build(exp, mesh)
  report_shardings(program)
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "ckpt"), keep=exp.checkpoint.keep,
                                       async_save=exp.checkpoint.async_save)
  state = init_or_restore(exp, program, checkpointer, train_iter)
  return Run(exp=exp, workdir=workdir, program=program, tokenizer=tokenizer,
             train_iter=train_iter, checkpointer=checkpointer, state=state,
             is_primary=jax.process_index() == 0)


# ------------------------------------------------------------------------------------- loop


def evaluate(run: Run, params) -> dict:
  """Token-weighted mean metrics over the first `eval_batches` held-out batches."""
  iterator = make_iterator(run.exp, run.tokenizer, "heldout")
  sums, weight = {}, 0.0
  for _ in range(run.exp.train.eval_batches):
    batch = loader.to_global(next(iterator), run.program.mesh)
    metrics = jax.device_get(run.program.eval_step(params, batch))
    tokens = float(metrics["tokens"])
    weight += tokens
    for key, value in metrics.items():
      if key != "tokens":
        sums[key] = sums.get(key, 0.0) + float(value) * tokens
  return {f"eval/{k}": v / max(weight, 1.0) for k, v in sums.items()}


def run_eval_suites(run: Run, writer: MetricWriter, step: int) -> dict:
  """The c2/evals suites of `train.eval_suites` on this step's params (process 0; the probes are
  a single-host program). Scalars go to the writer at `step`, figures to workdir/evals/plots."""
  from c2.envs import config as env_config  # pylint: disable=import-outside-toplevel
  from c2.evals import report, suites  # pylint: disable=import-outside-toplevel
  exp = run.exp
  if not run.is_primary:
    return {}
  options = suites.SuiteOptions(context=exp.data.seq_len, seed=exp.data.seed,
                                agentic_max_context=exp.rl.max_context or exp.data.seq_len,
                                **({"env": env_config.to_env_config(exp.env)} if exp.env else {}))
  return report.evaluate_in_training(
      suites.parse_suites(exp.train.eval_suites), exp.model, run.state.params, run.tokenizer,
      options, step=step, out_dir=os.path.join(run.workdir, "evals"), writer=writer,
      log=tqdm.tqdm.write)


def heldout_unigram_entropy(exp: ExperimentConfig, tokenizer: Tokenizer) -> float:
  """Unigram entropy (nats) of the eval batches' targets: the loss of a context-free model."""
  iterator = make_iterator(exp, tokenizer, "heldout")
  return corpus_stats.target_unigram_entropy(next(iterator) for _ in range(exp.train.eval_batches))


def _log_evaluation(run: Run, writer: MetricWriter, step: int, log) -> dict:
  """Held-out metrics of the current params, written at `step` and their CE printed."""
  eval_metrics = evaluate(run, run.state.params)
  writer.write_scalars(step, eval_metrics)
  log(f"step {step}: eval/ce {eval_metrics.get('eval/ce', float('nan')):.4f}")
  return eval_metrics


def _evaluate_at_start(run: Run, writer: MetricWriter) -> None:
  """Step-0 held-out loss and suites: what the run starts from, under this run's model config."""
  _log_evaluation(run, writer, 0, log=lambda line: print(line, flush=True))
  if run.exp.train.eval_suites:
    run_eval_suites(run, writer, 0)


def _write_run_header(run: Run, writer: MetricWriter) -> None:
  """Config, parameter counts and the held-out unigram entropy, once at step 0."""
  counts = flops.param_counts(run.exp.model)
  writer.write_config(dataclasses.asdict(run.exp), {"params/total": counts.total})
  entropy = heldout_unigram_entropy(run.exp, run.tokenizer)
  writer.write_scalars(0, {"eval/unigram_entropy": entropy, "params/total": counts.total,
                           "params/active": counts.active})
  print(f"held-out unigram entropy: {entropy:.3f} nats/token", flush=True)


class _Throughput:
  """Tokens/s, step time and MFU over the steps since the last log line."""

  def __init__(self, exp: ExperimentConfig):
    self.tokens_per_step = exp.data.global_batch_size * exp.data.seq_len
    self.flops_per_token = flops.train_flops_per_token(exp.model, exp.data.seq_len)
    self.peak, self.peak_source = hardware.peak_flops_per_device()
    self.start, self.steps = time.time(), 0

  def tick(self) -> None:
    self.steps += 1

  def window(self) -> dict:
    elapsed = time.time() - self.start
    tokens_per_sec = self.steps * self.tokens_per_step / elapsed
    scalars = {"perf/tokens_per_sec": tokens_per_sec,
               "perf/step_time_sec": elapsed / self.steps,
               "perf/mfu": tokens_per_sec * self.flops_per_token /
                           (self.peak * jax.device_count())}
    self.start, self.steps = time.time(), 0
    return scalars


def _log_train_metrics(run: Run, writer: MetricWriter, bar, step: int, metrics, throughput,
                       last_checked: int) -> dict:
  """Writes the step's metrics and the window's throughput; stops on a non-finite loss."""
  metrics = jax.device_get(metrics)
  if run.exp.train.nan_check and not np.isfinite(metrics["loss"]):
    raise NonFiniteLossError(
        f"non-finite loss {metrics['loss']} in steps ({last_checked}, {step}]; last "
        f"checkpoint: step {run.checkpointer.latest_step()}. Lower optim.peak_lr or enable "
        "train.z_loss_weight, then resume from that checkpoint.")
  scalars = {f"train/{k}": v for k, v in metrics.items()}
  scalars.update(throughput.window())
  writer.write_scalars(step, scalars)
  bar.set_postfix(loss=f"{float(metrics['loss']):.3f}",
                  tok_s=f"{scalars['perf/tokens_per_sec']:,.0f}")
  return metrics


def train_loop(run: Run, writer: MetricWriter, last_step: int) -> dict:
  """Steps from the state's step to last_step, logging, evaluating and saving on schedule.
  Runs under transfer_guard("disallow"): an implicit host<->device copy raises."""
  exp, program = run.exp, run.program
  step = int(jax.device_get(run.state.step))
  metrics, last_checked, started = {}, step, time.time()
  throughput = _Throughput(exp)
  bar = tqdm.tqdm(total=last_step, initial=step, disable=not run.is_primary, dynamic_ncols=True)
  with Preemption() as preemption, program.context(), jax.transfer_guard("disallow"):
    while step < last_step:
      batch = loader.to_global(next(run.train_iter), program.mesh)
      run.state, metrics = program.train_step(run.state, batch)
      step += 1
      throughput.tick()
      bar.update(1)
      out_of_time = (exp.train.max_minutes is not None
                     and time.time() - started > 60 * exp.train.max_minutes)
      stop = preemption.requested or out_of_time or step == last_step
      if step % exp.train.log_every == 0 or stop:
        metrics = _log_train_metrics(run, writer, bar, step, metrics, throughput, last_checked)
        last_checked = step
      if step % exp.train.eval_every == 0 or stop:
        metrics = {**metrics, **_log_evaluation(run, writer, step, tqdm.tqdm.write)}
      if exp.train.eval_suites and (step % (exp.train.eval_suites_every or exp.train.eval_every)
                                    == 0 or stop):
        metrics = {**metrics, **run_eval_suites(run, writer, step)}
      if step % exp.checkpoint.every_steps == 0 or stop:
        run.checkpointer.save(run.state, data_state=run.train_iter.get_state(), force=stop)
      if stop:
        if preemption.requested:
          print(f"SIGTERM: saved step {step}, exiting", flush=True)
        elif out_of_time:
          print(f"time budget of {exp.train.max_minutes} min reached at step {step}; saved",
                flush=True)
        break
  bar.close()
  return jax.device_get(metrics)


def run(exp: ExperimentConfig, workdir: str, *, max_steps: Optional[int] = None) -> dict:
  """Trains `exp` in `workdir` (resuming if it holds a checkpoint). Returns the last metrics.

  max_steps stops early at that step (tests; a stand-in for a preemption at a known step).
  """
  run_ = prepare(exp, workdir)
  writer = MetricWriter(os.path.join(workdir, "tb"), enabled=run_.is_primary)
  if int(jax.device_get(run_.state.step)) == 0:
    with run_.program.context():
      _write_run_header(run_, writer)
      if exp.train.eval_at_start:
        _evaluate_at_start(run_, writer)
  metrics = train_loop(run_, writer, min(exp.train.steps, max_steps or exp.train.steps))
  run_.checkpointer.close()
  writer.close()
  if run_.is_primary:
    tb = os.path.join(workdir, "tb")
    peak, source = hardware.peak_flops_per_device()
    print(f"\nTensorBoard logs: {tb}\n"
          f"Checkpoints:      {run_.checkpointer.directory} "
          f"(steps {run_.checkpointer.all_steps()})\n"
          f"Open the curves:  tensorboard --logdir {tb}\n"
          f"MFU baseline: {peak / 1e12:.2f} TFLOP/s per device ({source})", flush=True)
  return {k: float(np.asarray(v)) for k, v in metrics.items()}
