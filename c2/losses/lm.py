"""The language-model objective shared by pretraining, long-context and SFT steps.

  loss = CE(main head) + z-loss + mtp_weight * mean_k L_MTP^k + balance_weight * mean_l L_bal^l
L_MTP^k is Composer 2's self-distillation (KL from the main head's exact distribution at the
position that predicts the same token), data CE, or both. Every term is a sum divided by its own
weight sum, so packing and padding never change a mean. Returns the scalar loss and metrics.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from c2 import model as model_lib
from c2.data import zigzag
from c2.losses import head as head_loss
from c2.losses import targets as targets_lib
from c2.model.config import ModelConfig
from c2.ops.context_attention import context_shards


@dataclasses.dataclass(frozen=True)
class LossWeights:
  """Plain numbers the objective needs (built by the trainer from TrainConfig)."""

  ce_chunk_size: int = 2048
  z_loss_weight: float = 0.0
  mtp_weight: float = 0.3
  mtp_loss: str = "distill"  # distill | ce | distill+ce
  mtp_detach_trunk: bool = True  # MTP gradients stop at the trunk's hidden state
  balance_loss_weight: float = 0.0
  ce_weighted_only: bool = False  # project only weighted tokens (HeadLossSpec.weighted_only)
  focal_gamma: float = 0.0  # HeadLossSpec.focal_gamma


def _safe_div(a, b):
  return a / jnp.maximum(b, 1.0)


def _flat(x):
  return x.reshape((-1,) + x.shape[2:])


def _zigzag_align_mtp(mtp_hidden, mtp_weights, depth, *, num_shards):
  """head_loss.align_mtp for zig-zag rows: one static gather along T (the batch was permuted for
  the mesh's context shards). Under context parallelism XLA moves the MTP hidden state between
  shards for it: one activation's worth of traffic per MTP depth."""
  index, valid = zigzag.shift_right_index(mtp_hidden.shape[1], num_shards, depth)
  gather = lambda x: jnp.where(valid.reshape((1, -1) + (1,) * (x.ndim - 2)),
                               jnp.take(x, index, axis=1), 0).astype(x.dtype)
  return gather(mtp_hidden), gather(mtp_weights)


def lm_loss(cfg: ModelConfig, params: Any, batch: dict, weights: LossWeights,
            forced_routes=None) -> tuple[jax.Array, dict]:
  """batch: tokens, segment_ids, positions [B, T] int32, loss_mask [B, T] float32; a zig-zag
  batch (c2/data/zigzag.py) also holds its look-ahead arrays, and runs the model in that layout.

  Returns (loss, aux) where aux holds scalar metrics under "metrics" and, for MoE models, the
  per-expert loads by router group under "router_load" (c2.model.router_loads: trunk [L, E],
  mtp [M, E]) that drive the bias update.
  """
  tokens, segments, mask = batch["tokens"], batch["segment_ids"], batch["loss_mask"]
  use_mtp = cfg.mtp_depth > 0 and weights.mtp_weight > 0
  detach = weights.mtp_detach_trunk
  mtp_tokens, align = None, head_loss.align_mtp
  if zigzag.is_zigzag(batch):  # zig-zag rows: no shifts along T
    cfg = cfg.replace(sequence_layout="zigzag")
    mtp_tokens = [targets_lib.lookahead_tokens(batch, k) for k in range(1, cfg.mtp_depth + 1)]
    align = functools.partial(_zigzag_align_mtp, num_shards=context_shards(tokens.shape[1]))
  out = model_lib.forward(cfg, params, tokens, segments, batch["positions"], forced_routes,
                          with_mtp=use_mtp, detach_mtp_inputs=detach, mtp_tokens=mtp_tokens)
  head = model_lib.head_kernel(cfg, params)
  targets, target_w = targets_lib.batch_targets(batch, offset=1)
  mtp_hidden = mtp_w = None
  if use_mtp:
    # Depth k's state at position t predicts token t+1+k: align it with the main position t+k
    # so the fused head pass sees student, teacher and target of a token together.
    aligned = [align(out["mtp_hidden"][k - 1], targets_lib.batch_targets(
        batch, offset=1 + k)[1], k) for k in range(1, cfg.mtp_depth + 1)]
    mtp_hidden = jnp.stack([_flat(h) for h, _ in aligned], axis=1)  # [N, M, D]
    mtp_w = jnp.stack([_flat(w) for _, w in aligned], axis=1)  # [N, M]
  spec = head_loss.HeadLossSpec(
      chunk_size=weights.ce_chunk_size, z_loss_weight=weights.z_loss_weight,
      mtp_weight=weights.mtp_weight if use_mtp else 0.0,
      mtp_distill="distill" in weights.mtp_loss, mtp_ce="ce" in weights.mtp_loss.split("+"),
      mtp_trains_head=not detach, weighted_only=weights.ce_weighted_only,
      focal_gamma=weights.focal_gamma)
  loss, sums = head_loss.head_loss(spec, _flat(out["hidden"]), head, _flat(targets),
                                   _flat(target_w), mtp_hidden, mtp_w)
  metrics = {"ce": _safe_div(sums["ce_sum"], sums["weight_sum"]),
             "z_loss": _safe_div(sums["z_loss_sum"], sums["weight_sum"]),
             "accuracy": _safe_div(sums["correct_sum"], sums["weight_sum"]),
             "tokens": sums["weight_sum"]}
  for k in range(1, cfg.mtp_depth + 1 if use_mtp else 1):
    per_depth = {name: _safe_div(sums[f"mtp_{name}_sum"][k - 1], sums["mtp_weight_sum"][k - 1])
                 for name in ("kl", "top1_agree", "accept", "ce")}
    metrics[f"mtp/{k}/ce"] = per_depth["ce"]  # logged in every mode: comparable across runs
    if spec.mtp_distill:
      metrics[f"mtp/{k}/kl"] = per_depth["kl"]
      metrics[f"mtp/{k}/top1_agreement"] = per_depth["top1_agree"]
      metrics[f"mtp/{k}/acceptance"] = per_depth["accept"]
    metrics[f"mtp/{k}/loss"] = spec.mtp_distill * per_depth["kl"] + spec.mtp_ce * per_depth["ce"]

  aux = {"metrics": metrics}
  if cfg.num_moe_layers:
    balance = jnp.mean(out["aux"]["moe"]["balance_loss"])
    metrics["moe/balance_loss"] = balance
    # Python float: at full scale the count of token-choices (1.6e10) overflows int32.
    choices = float(tokens.size) * cfg.experts_per_token * cfg.num_moe_layers
    dropped = out["aux"]["moe"]["dropped"].astype(jnp.float32)
    metrics["moe/dropped_fraction"] = jnp.sum(dropped) / choices
    if weights.balance_loss_weight:
      loss = loss + weights.balance_loss_weight * balance
    aux["router_load"] = model_lib.router_loads(out["aux"])
  metrics["loss"] = loss
  return loss, aux

