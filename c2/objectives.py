"""The language-model objective shared by pretraining, long-context and SFT steps.

  loss = CE(main head) + z-loss + mtp_weight * mean_k L_MTP^k + balance_weight * mean_l L_bal^l
L_MTP^k is Composer 2's self-distillation (KL from the main head's exact distribution at the
position that predicts the same token), data CE, or both. Every term is a sum divided by its own
weight sum, so packing and padding never change a mean. Returns the scalar loss and metrics.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from c2 import losses
from c2 import model as model_lib
from c2.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LossWeights:
  """Plain numbers the objective needs (built by the trainer from TrainConfig)."""

  ce_chunk_size: int = 2048
  z_loss_weight: float = 0.0
  mtp_weight: float = 0.3
  mtp_loss: str = "distill"  # distill | ce | distill+ce
  mtp_detach_trunk: bool = True  # MTP gradients stop at the trunk's hidden state
  balance_loss_weight: float = 0.0


def _safe_div(a, b):
  return a / jnp.maximum(b, 1.0)


def _flat(x):
  return x.reshape((-1,) + x.shape[2:])


def lm_loss(cfg: ModelConfig, params: Any, batch: dict, weights: LossWeights,
            forced_routes=None) -> tuple[jax.Array, dict]:
  """batch: tokens, segment_ids, positions [B, T] int32, loss_mask [B, T] float32.

  Returns (loss, aux) where aux holds scalar metrics under "metrics" and the per-expert loads
  ("moe_load" [L, E], "mtp_load" [M, E]) that drive the bias update.
  """
  tokens, segments, mask = batch["tokens"], batch["segment_ids"], batch["loss_mask"]
  use_mtp = cfg.mtp_depth > 0 and weights.mtp_weight > 0
  detach = weights.mtp_detach_trunk
  out = model_lib.forward(cfg, params, tokens, segments, batch["positions"], forced_routes,
                          with_mtp=use_mtp, detach_mtp_inputs=detach)
  head = model_lib.head_kernel(cfg, params)
  mtp_head = jax.lax.stop_gradient(head) if detach else head
  targets, target_w = losses.next_token_targets(tokens, segments, mask, offset=1)
  ce = losses.chunked_softmax_xent(_flat(out["hidden"]), head, _flat(targets), _flat(target_w),
                                   chunk_size=weights.ce_chunk_size,
                                   z_loss_weight=weights.z_loss_weight)
  loss = _safe_div(ce["loss_sum"] + ce["z_loss_sum"], ce["weight_sum"])
  metrics = {"ce": _safe_div(ce["loss_sum"], ce["weight_sum"]),
             "z_loss": _safe_div(ce["z_loss_sum"], ce["weight_sum"]),
             "accuracy": _safe_div(ce["correct_sum"], ce["weight_sum"]),
             "tokens": ce["weight_sum"]}

  if use_mtp:
    mtp_total = 0.0
    for k in range(1, cfg.mtp_depth + 1):
      student = out["mtp_hidden"][k - 1]
      mtp_targets, mtp_w = losses.next_token_targets(tokens, segments, mask, offset=1 + k)
      depth_loss = 0.0
      if "distill" in weights.mtp_loss:
        teacher = losses.shift_left(out["hidden"], k)
        kl = losses.chunked_distill_kl(_flat(student), _flat(teacher),
                                       jax.lax.stop_gradient(head), _flat(mtp_w),
                                       chunk_size=weights.ce_chunk_size)
        depth_loss += _safe_div(kl["kl_sum"], kl["weight_sum"])
        metrics[f"mtp/{k}/kl"] = _safe_div(kl["kl_sum"], kl["weight_sum"])
        metrics[f"mtp/{k}/top1_agreement"] = _safe_div(kl["top1_agree_sum"], kl["weight_sum"])
        metrics[f"mtp/{k}/acceptance"] = _safe_div(kl["accept_sum"], kl["weight_sum"])
      mtp_ce = losses.chunked_softmax_xent(_flat(student), mtp_head, _flat(mtp_targets),
                                           _flat(mtp_w),
                                           chunk_size=weights.ce_chunk_size)
      mtp_ce_mean = _safe_div(mtp_ce["loss_sum"], mtp_ce["weight_sum"])
      metrics[f"mtp/{k}/ce"] = mtp_ce_mean  # logged in every mode: comparable across runs
      if "ce" in weights.mtp_loss.split("+"):
        depth_loss += mtp_ce_mean
      metrics[f"mtp/{k}/loss"] = depth_loss
      mtp_total += depth_loss
    loss = loss + weights.mtp_weight * mtp_total / cfg.mtp_depth

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
    aux["moe_load"] = out["aux"]["moe"]["load"]
    if "mtp_moe" in out["aux"]:
      aux["mtp_load"] = out["aux"]["mtp_moe"]["load"]
  metrics["loss"] = loss
  return loss, aux

