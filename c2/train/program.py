"""The program of a run, built in one place for the trainer and for the AOT check.

  program = build(exp, mesh)                  optimizer, step context, shardings, jitted steps
  with program.context(): program.train_step(state, batch)          what `c2.train.loop` runs
  program.lower()                             what `c2.perf.aot` compiles for a TPU topology
The two differ only in the mesh's devices (real ones, or a TPU topology's compile-only devices)
and the Pallas target generation, never in the step, its shardings or its arguments: the test
tests/train/test_program.py checks that both lower to the same module text.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels
from c2 import optim
from c2.config import ExperimentConfig
from c2.data import loader, zigzag
from c2.losses import targets as targets_lib
from c2.losses.lm import LossWeights
from c2.losses.rl import RLLossWeights
from c2.model import ROUTER_BIAS
from c2.parallel.sharding import with_shardings
from c2.steps import STEPS, StepContext
from c2.steps import rl as rl_steps
from c2.train import state as state_lib

BATCH_DTYPES = {"tokens": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
                "loss_mask": jnp.float32, "advantages": jnp.float32, "sampler_logp": jnp.float32,
                "ref_logp": jnp.float32, "forced_routes": jnp.int32,
                **{key: dtype for k in range(1, 9) for key, dtype in zip(
                    targets_lib.lookahead_keys(k), (jnp.int32, jnp.float32))}}
# The production matmul precision, pinned so that the trainer and the AOT check lower the same
# program whatever the process-wide setting (the CPU tests set "highest"; Mosaic kernels reject
# HIGHEST on bf16 operands).
MATMUL_PRECISION = "default"


def make_optimizer(exp: ExperimentConfig) -> optim.Optimizer:
  o = exp.optim
  return optim.build_optimizer(
      peak_lr=o.peak_lr, total_steps=exp.train.steps, warmup_steps=o.warmup_steps,
      schedule=o.schedule, decay_fraction=o.decay_fraction, decay_shape=o.decay_shape,
      final_lr=o.peak_lr * o.min_lr_ratio, b1=o.b1, b2=o.b2, eps=o.eps,
      weight_decay=o.weight_decay, clip_norm=o.clip_norm or None,
      frozen_patterns=(ROUTER_BIAS,), use_muon=o.name == "muon", muon_momentum=o.muon_momentum)


def step_context(exp: ExperimentConfig, optimizer: optim.Optimizer) -> StepContext:
  t = exp.train
  weights = LossWeights(ce_chunk_size=t.ce_chunk_size, z_loss_weight=t.z_loss_weight,
                        mtp_weight=t.mtp_weight, mtp_loss=t.mtp_loss,
                        mtp_detach_trunk=t.mtp_detach_trunk,
                        balance_loss_weight=t.balance_loss_weight,
                        ce_weighted_only=t.ce_weighted_only, focal_gamma=t.focal_gamma)
  return StepContext(model=exp.model, tx=optimizer.tx, loss_weights=weights,
                     bias_update_rate=t.bias_update_rate, schedule=optimizer.schedule,
                     rl=rl_loss_weights(exp) if exp.phase == "rl" else None)


def rl_loss_weights(exp: ExperimentConfig) -> RLLossWeights:
  rl = exp.rl
  return RLLossWeights(
      normalizer=rl.normalizer or float(exp.data.global_batch_size * exp.data.seq_len),
      chunk_size=exp.train.ce_chunk_size, kl_coef=rl.kl_coef, kl_placement=rl.kl_placement,
      is_cap=rl.is_cap, replay_fallback=rl.replay_fallback,
      weighted_only=exp.train.ce_weighted_only, min_entropy=rl.min_token_entropy)


def uses_reference(exp: ExperimentConfig) -> bool:
  """Whether the RL batch carries the reference policy's log-probs (the k1 KL term)."""
  return exp.phase == "rl" and exp.rl.kl_coef > 0 and exp.rl.kl_placement != "none"


def batch_transform(exp: ExperimentConfig, context: int) -> Optional[zigzag.ZigzagTransform]:
  """The host-side transform of the phase's batches on a mesh with `context` shards: zig-zag
  rows under latent context parallelism (c2/data/zigzag.py), else None."""
  return zigzag.transform_for(context=context, context_parallel=exp.model.context_parallel,
                              phase=exp.phase, mtp_depth=exp.model.mtp_depth)


def batch_keys(exp: ExperimentConfig, context: int = 1) -> tuple[str, ...]:
  if exp.phase != "rl":
    transform = batch_transform(exp, context)
    return loader.BATCH_KEYS + (transform.keys() if transform else ())
  keys = loader.BATCH_KEYS + ("advantages", "sampler_logp")
  if uses_reference(exp):
    keys += ("ref_logp",)
  if exp.rl.router_replay and exp.model.num_moe_layers:
    keys += ("forced_routes",)
  return keys


@dataclasses.dataclass(frozen=True)
class Program:
  """A phase's jitted steps with every sharding they take and give, on one mesh."""
  mesh: jax.sharding.Mesh
  optimizer: optim.Optimizer
  ctx: StepContext
  state_shardings: state_lib.TrainState
  abstract_state: state_lib.TrainState  # ShapeDtypeStructs carrying state_shardings
  abstract_batch: dict  # ShapeDtypeStructs carrying the batch shardings
  train_step: Callable  # (state, batch) -> (state, metrics); donates the state
  eval_step: Callable  # (params, batch) -> metrics
  target_generation: Optional[str] = None  # Pallas kernels' TPU generation when not this host's
  reference_logp: Optional[Callable] = None  # rl: (ref params, batch) -> ref_logp [B, T]

  @contextlib.contextmanager
  def context(self):
    """Mesh, Pallas target and matmul precision under which the steps are traced and run."""
    target = (pallas_kernels.use_target(self.target_generation) if self.target_generation
              else contextlib.nullcontext())
    with jax.set_mesh(self.mesh), target, jax.default_matmul_precision(MATMUL_PRECISION):
      yield

  def lower(self):
    """The train step lowered for the abstract state and batch (what the AOT check compiles)."""
    with self.context():
      return self.train_step.lower(self.abstract_state, self.abstract_batch)

  def init_state(self, seed: int) -> state_lib.TrainState:
    """Fresh state, every array created directly in its shards."""
    with self.context():
      return state_lib.init_state(self.ctx.model, self.optimizer.tx, jax.random.key(seed),
                                  self.state_shardings)


def abstract_batch(exp: ExperimentConfig, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  b, t = exp.data.global_batch_size, exp.data.seq_len
  out = {}
  for key in batch_keys(exp, mesh.shape["context"]):
    shape = ((exp.model.num_moe_layers, b, t, exp.model.experts_per_token)
             if key == "forced_routes" else (b, t))
    sharding = loader.batch_sharding(mesh, shape, loader.batch_axis_names(key, len(shape)))
    out[key] = jax.ShapeDtypeStruct(shape, BATCH_DTYPES[key], sharding=sharding)
  return out


def build(exp: ExperimentConfig, mesh: jax.sharding.Mesh, *,
          target_generation: Optional[str] = None) -> Program:
  """The phase's steps (from c2.steps.STEPS) jitted with explicit shardings on `mesh`."""
  optimizer = make_optimizer(exp)
  ctx = step_context(exp, optimizer)
  abstract = state_lib.abstract_state(exp.model, optimizer.tx)
  shardings = state_lib.state_shardings(exp.model, optimizer.tx, mesh, abstract)
  batch = abstract_batch(exp, mesh)
  batch_shardings = {key: value.sharding for key, value in batch.items()}
  replicated = NamedSharding(mesh, P())
  steps = STEPS[exp.phase]
  train_step = jax.jit(functools.partial(steps.train, ctx=ctx),
                       in_shardings=(shardings, batch_shardings),
                       out_shardings=(shardings, replicated), donate_argnums=0)
  eval_step = jax.jit(functools.partial(steps.eval, ctx=ctx),
                      in_shardings=(shardings.params, batch_shardings), out_shardings=replicated)
  reference_logp = None
  if uses_reference(exp):
    reference_logp = jax.jit(
        functools.partial(rl_steps.rl_reference_logp, ctx=ctx),
        in_shardings=(shardings.params,
                      {k: v for k, v in batch_shardings.items() if k != "ref_logp"}),
        out_shardings=batch_shardings["tokens"])
  return Program(mesh=mesh, optimizer=optimizer, ctx=ctx, state_shardings=shardings,
                 abstract_state=with_shardings(abstract, shardings), abstract_batch=batch,
                 train_step=train_step, eval_step=eval_step, target_generation=target_generation,
                 reference_logp=reference_logp)
