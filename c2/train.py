"""The training loop, top to bottom: mesh -> data -> abstract state -> shardings -> init or
restore -> step -> loop. The only side-effecting part of c2; everything it calls is pure or a
small object with one job (Checkpointer, MetricWriter).

Safety rails: automatic resume from workdir/ckpt (model, optimizer and data-iterator state, so a
resumed run continues with exactly the next batch); save on SIGTERM (preemption), on the time
budget and at the end; a NaN/inf check that stops the run naming the step window; only process
0 writes metrics and config.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import time
from typing import Optional

import jax
import numpy as np
import tqdm

from c2 import checkpoint as ckpt_lib
from c2 import flops, hardware
from c2 import mesh as meshlib
from c2 import optim
from c2 import sharding
from c2 import state as state_lib
from c2.config import ExperimentConfig
from c2.data import corpus_stats, loader
from c2.data.tokenizer import load_tokenizer
from c2.metrics import MetricWriter
from c2.objectives import LossWeights
from c2.steps import STEPS
from c2.steps.pretrain import ROUTER_BIAS_PATTERN, eval_step


class NonFiniteLossError(RuntimeError):
  pass


def make_optimizer(exp: ExperimentConfig) -> optim.Optimizer:
  o = exp.optim
  return optim.build_optimizer(
      peak_lr=o.peak_lr, total_steps=exp.train.steps, warmup_steps=o.warmup_steps,
      schedule=o.schedule, decay_fraction=o.decay_fraction, decay_shape=o.decay_shape,
      final_lr=o.peak_lr * o.min_lr_ratio, b1=o.b1, b2=o.b2, eps=o.eps,
      weight_decay=o.weight_decay, clip_norm=o.clip_norm or None,
      frozen_patterns=(ROUTER_BIAS_PATTERN,), use_muon=o.name == "muon",
      muon_momentum=o.muon_momentum)


def loss_weights(exp: ExperimentConfig) -> LossWeights:
  t = exp.train
  return LossWeights(ce_chunk_size=t.ce_chunk_size, z_loss_weight=t.z_loss_weight,
                     mtp_weight=t.mtp_weight, mtp_loss=t.mtp_loss,
                     mtp_detach_trunk=t.mtp_detach_trunk,
                     balance_loss_weight=t.balance_loss_weight)


def make_train_step(exp: ExperimentConfig, tx, schedule):
  """The phase's pure step with its keyword arguments bound (also used by `c2.aot`)."""
  return functools.partial(STEPS[exp.phase], model_cfg=exp.model, tx=tx,
                           loss_weights=loss_weights(exp),
                           bias_update_rate=exp.train.bias_update_rate, schedule=schedule)


class _Preemption:
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


def _evaluate(exp, params, eval_fn, tokenizer, mesh) -> dict:
  """Mean metrics over the first `eval_batches` held-out batches (the same ones every time)."""
  iterator = loader.make_iterator(
      phase=exp.phase, source=exp.data.eval_source or exp.data.source, tokenizer=tokenizer,
      seq_len=exp.data.seq_len, global_batch_size=exp.data.global_batch_size, seed=exp.data.seed,
      split="heldout", num_epochs=None)
  sums, weight = {}, 0.0
  for _ in range(exp.train.eval_batches):
    metrics = jax.device_get(eval_fn(params, loader.to_global(next(iterator), mesh)))
    tokens = float(metrics["tokens"])
    weight += tokens
    for key, value in metrics.items():
      if key != "tokens":
        sums[key] = sums.get(key, 0.0) + float(value) * tokens
  return {f"eval/{k}": v / max(weight, 1.0) for k, v in sums.items()}


def heldout_unigram_entropy(exp, tokenizer) -> float:
  """Unigram entropy (nats) of the eval batches' targets: the loss of a context-free model."""
  iterator = loader.make_iterator(
      phase=exp.phase, source=exp.data.eval_source or exp.data.source, tokenizer=tokenizer,
      seq_len=exp.data.seq_len, global_batch_size=exp.data.global_batch_size, seed=exp.data.seed,
      split="heldout", num_epochs=None)
  return corpus_stats.target_unigram_entropy(next(iterator) for _ in range(exp.train.eval_batches))


def run(exp: ExperimentConfig, workdir: str, *, max_steps: Optional[int] = None) -> dict:
  """Trains `exp` in `workdir` (resuming if it holds a checkpoint). Returns the last metrics.

  max_steps stops early at that step (tests; a stand-in for a preemption at a known step).
  """
  is_primary = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True) if "://" not in workdir else None

  # --- mesh ---
  axis_sizes = exp.validate_for_devices(jax.device_count())
  mesh = meshlib.make_mesh(axis_sizes, num_slices=exp.mesh.num_slices)
  logging.info("mesh %s on %d devices (%d processes)", dict(mesh.shape), jax.device_count(),
               jax.process_count())

  # --- data ---
  tokenizer = load_tokenizer(exp.data.tokenizer, cache_dir=workdir,
                             default_vocab_size=exp.data.tokenizer_vocab_size)
  if tokenizer.vocab_size > exp.model.vocab_size:
    raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but config.model.vocab_size is "
                     f"{exp.model.vocab_size}; raise model.vocab_size or shrink the tokenizer")
  train_iter = loader.make_iterator(
      phase=exp.phase, source=exp.data.source, tokenizer=tokenizer, seq_len=exp.data.seq_len,
      global_batch_size=exp.data.global_batch_size, seed=exp.data.seed, split="train",
      text_field=exp.data.text_field, sft_train_on=exp.data.sft_train_on,
      read_threads=exp.data.read_threads, num_workers=exp.data.num_workers)

  # --- abstract state and shardings ---
  opt = make_optimizer(exp)
  abstract = state_lib.abstract_state(exp.model, opt.tx)
  shardings = state_lib.state_shardings(exp.model, opt.tx, mesh)
  rows = sharding.report(abstract.params, shardings.params)
  logging.info("parameters:\n%s", sharding.format_report(rows))
  sharding.check_replication(rows, mesh.size)

  # --- init or restore ---
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "ckpt"), keep=exp.checkpoint.keep,
                                       async_save=exp.checkpoint.async_save)
  with jax.set_mesh(mesh):
    if checkpointer.latest_step() is not None:
      with_shardings = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                    abstract, shardings)
      state, meta = checkpointer.restore(with_shardings)
      if meta.get("data_state") is not None:
        train_iter.set_state(meta["data_state"])
      print(f"resumed from {checkpointer.directory} at step {int(state.step)}", flush=True)
    else:
      state = state_lib.init_state(exp.model, opt.tx, jax.random.key(exp.train.seed), shardings)
      if exp.train.init_from:
        state = _load_init_from(exp, state, shardings)

  # --- step ---
  batch_shape = (exp.data.global_batch_size, exp.data.seq_len)
  batch_shardings = {k: loader.batch_sharding(mesh, batch_shape) for k in loader.BATCH_KEYS}
  train_step = jax.jit(make_train_step(exp, opt.tx, opt.schedule),
                       in_shardings=(shardings, batch_shardings),
                       out_shardings=(shardings, None), donate_argnums=0)
  eval_fn = jax.jit(functools.partial(eval_step, model_cfg=exp.model,
                                      loss_weights=loss_weights(exp)),
                    in_shardings=(shardings.params, batch_shardings))

  # --- loop ---
  writer = MetricWriter(os.path.join(workdir, "tb"), enabled=is_primary)
  counts = flops.param_counts(exp.model)
  flops_per_token = flops.train_flops_per_token(exp.model, exp.data.seq_len)
  peak, peak_source = hardware.peak_flops_per_device()
  tokens_per_step = exp.data.global_batch_size * exp.data.seq_len
  start_step = int(jax.device_get(state.step))
  last_step = min(exp.train.steps, max_steps or exp.train.steps)
  if start_step == 0:
    writer.write_config(dataclasses.asdict(exp), {"params/total": counts.total})
    with jax.set_mesh(mesh):
      entropy = heldout_unigram_entropy(exp, tokenizer)
    writer.write_scalars(0, {"eval/unigram_entropy": entropy, "params/total": counts.total,
                             "params/active": counts.active})
    print(f"held-out unigram entropy: {entropy:.3f} nats/token", flush=True)

  metrics, last_checked = {}, start_step
  started, window_start, window_steps = time.time(), time.time(), 0
  bar = tqdm.tqdm(total=last_step, initial=start_step, disable=not is_primary, dynamic_ncols=True)
  with _Preemption() as preemption, jax.set_mesh(mesh):
    step = start_step
    while step < last_step:
      batch = loader.to_global(next(train_iter), mesh)
      state, metrics = train_step(state, batch)
      step += 1
      window_steps += 1
      bar.update(1)
      out_of_time = (exp.train.max_minutes is not None
                     and time.time() - started > 60 * exp.train.max_minutes)
      stop = preemption.requested or out_of_time or step == last_step
      if step % exp.train.log_every == 0 or stop:
        metrics = jax.device_get(metrics)
        elapsed = time.time() - window_start
        scalars = {f"train/{k}": v for k, v in metrics.items()}
        if exp.train.nan_check and not np.isfinite(metrics["loss"]):
          raise NonFiniteLossError(
              f"non-finite loss {metrics['loss']} in steps ({last_checked}, {step}]; last "
              f"checkpoint: step {checkpointer.latest_step()}. Lower optim.peak_lr or enable "
              "train.z_loss_weight, then resume from that checkpoint.")
        last_checked = step
        tokens_per_sec = window_steps * tokens_per_step / elapsed
        scalars.update({
            "perf/tokens_per_sec": tokens_per_sec,
            "perf/step_time_sec": elapsed / window_steps,
            "perf/mfu": tokens_per_sec * flops_per_token / (peak * jax.device_count()),
        })
        writer.write_scalars(step, scalars)
        bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", tok_s=f"{tokens_per_sec:,.0f}")
        window_start, window_steps = time.time(), 0
      if step % exp.train.eval_every == 0 or stop:
        eval_metrics = _evaluate(exp, state.params, eval_fn, tokenizer, mesh)
        writer.write_scalars(step, eval_metrics)
        metrics = {**metrics, **eval_metrics}
        tqdm.tqdm.write(f"step {step}: eval/ce {eval_metrics.get('eval/ce', float('nan')):.4f}")
      if step % exp.checkpoint.every_steps == 0 or stop:
        checkpointer.save(state, data_state=train_iter.get_state(), force=stop)
      if stop:
        if preemption.requested:
          print(f"SIGTERM: saved step {step}, exiting", flush=True)
        elif out_of_time:
          print(f"time budget of {exp.train.max_minutes} min reached at step {step}; saved",
                flush=True)
        break
  bar.close()
  checkpointer.close()
  writer.close()
  if is_primary:
    print(f"\nTensorBoard logs: {os.path.join(workdir, 'tb')}\n"
          f"Checkpoints:      {checkpointer.directory} (steps {checkpointer.all_steps()})\n"
          f"Open the curves:  tensorboard --logdir {os.path.join(workdir, 'tb')}\n"
          f"MFU baseline: {peak / 1e12:.2f} TFLOP/s per device ({peak_source})", flush=True)
  return {k: float(np.asarray(v)) for k, v in metrics.items()}


def _load_init_from(exp: ExperimentConfig, state: state_lib.TrainState, shardings):
  """Params from another run's checkpoint; modules it lacks (e.g. new MTP heads) stay fresh."""
  abstract_params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                 state.params, shardings.params)
  restored, missing = ckpt_lib.restore_params_subset(exp.train.init_from, abstract_params)
  params = {**state.params, **restored}
  print(f"init_from {exp.train.init_from}: restored {sorted(restored)}; freshly initialised "
        f"{missing}", flush=True)
  return state.replace(params=params,
                       opt_state=jax.jit(make_optimizer(exp).tx.init,
                                         out_shardings=shardings.opt_state)(params))
