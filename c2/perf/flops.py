"""Analytic parameter and FLOP counts for the MoE + MLA + MTP model.

Counts follow the parameter tree exactly (tested against `jax.eval_shape` of init), so they also
serve the MFU and AOT reports. "Active" parameters are those one token touches: every dense
weight plus `experts_per_token` of the routed experts (the router and its bias count fully).
"""
from __future__ import annotations

import dataclasses

from c2.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  total: int
  active: int
  embedding: int  # input embedding table (a lookup, no matmul FLOPs)
  mtp_total: int
  mtp_active: int

  @property
  def total_without_mtp(self) -> int:
    return self.total - self.mtp_total

  @property
  def active_without_mtp(self) -> int:
    return self.active - self.mtp_active


def _attention_params(cfg: ModelConfig) -> int:
  d, h = cfg.hidden_size, cfg.num_heads
  if cfg.q_lora_rank is None:
    q = d * h * cfg.qk_head_dim
  else:
    q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
  kv = (d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
        + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
  return q + kv + h * cfg.v_head_dim * d


def _block_params(cfg: ModelConfig, moe: bool, experts_counted: int) -> int:
  d = cfg.hidden_size
  norms = 2 * d
  if not moe:
    return _attention_params(cfg) + norms + 3 * d * cfg.dense_ffn_size
  router = d * cfg.num_routed_experts + cfg.num_routed_experts
  experts = 3 * experts_counted * d * cfg.moe_ffn_size
  shared = 3 * d * cfg.shared_ffn_size
  return _attention_params(cfg) + norms + router + experts + shared


def param_counts(cfg: ModelConfig) -> ParamCounts:
  d, v = cfg.hidden_size, cfg.vocab_size
  embedding = v * d
  head = 0 if cfg.tie_word_embeddings else d * v
  common = embedding + head + d  # + final norm

  def layers(experts_counted: int) -> int:
    return (cfg.first_k_dense * _block_params(cfg, False, 0)
            + cfg.num_moe_layers * _block_params(cfg, True, experts_counted))

  def mtp(experts_counted: int) -> int:
    per_depth = 3 * d + 2 * d * d + _block_params(cfg, cfg.num_moe_layers > 0, experts_counted)
    return cfg.mtp_depth * per_depth

  e, k = cfg.num_routed_experts, cfg.experts_per_token
  mtp_total, mtp_active = mtp(e), mtp(k)
  return ParamCounts(total=common + layers(e) + mtp_total, active=common + layers(k) + mtp_active,
                     embedding=embedding, mtp_total=mtp_total, mtp_active=mtp_active)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
  """Forward FLOPs of the score and value matmuls per token, per layer stack (main model).

  Per layer and token: 2 * H * T_ctx * (K + J), with T_ctx = seq_len / 2 on average when causal.
  """
  context = seq_len / 2 if causal else seq_len
  per_layer = 2 * cfg.num_heads * context * (cfg.qk_head_dim + cfg.v_head_dim)
  return per_layer * (cfg.num_layers + cfg.mtp_depth)


def train_flops_per_token(cfg: ModelConfig, seq_len: int, with_mtp: bool = True) -> float:
  """Useful training FLOPs per token: 6 x active matmul params + 3 x attention forward FLOPs.

  The embedding lookup is not a matmul; the output head is (and is re-used by every MTP depth).
  """
  counts = param_counts(cfg)
  matmul_params = counts.active - counts.embedding
  if not with_mtp:
    matmul_params -= counts.mtp_active
  elif cfg.mtp_depth:
    head = cfg.hidden_size * cfg.vocab_size
    matmul_params += cfg.mtp_depth * head  # each depth projects onto the vocabulary again
  attention = attention_flops_per_token(cfg, seq_len)
  if not with_mtp:
    attention = attention * cfg.num_layers / (cfg.num_layers + cfg.mtp_depth)
  return 6.0 * matmul_params + 3.0 * attention


def forward_flops(cfg: ModelConfig, start: int, end: int) -> float:
  """Inference FLOPs of the main model for the tokens at positions [start, end) of one sequence,
  the first `start` already cached: 2 x matmul params per token (the head included, the embedding
  lookup and the MTP modules not) plus the score and value matmuls over the p + 1 keys that the
  token at position p attends to. Prefill of a prompt is (0, prompt); each decoded token is
  (p, p + 1); an agentic turn that re-sends its whole context is (0, context) + its decode."""
  if not 0 <= start <= end:
    raise ValueError(f"need 0 <= start <= end, got {start}, {end}")
  counts = param_counts(cfg)
  matmul_params = counts.active - counts.embedding - counts.mtp_active
  keys = (end * (end + 1) - start * (start + 1)) / 2  # sum over p in [start, end) of p + 1
  attention = 2 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * cfg.num_layers * keys
  return 2.0 * matmul_params * (end - start) + attention
