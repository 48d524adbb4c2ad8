"""The model's typed configuration: every field of the Kimi K2 / K2.5 (DeepseekV3-family) text config.

`ModelConfig` is frozen and validates itself, so a wrong shape stops a run before anything compiles.
Presets:
  - `kimi-k2.5`: the real 1.04T-parameter shape (61 layers, 384 routed experts, MLA, YaRN x64).
  - `kimi-k2`:   Kimi-K2-Instruct 0711 (YaRN x32, beta_fast 1, eps 1e-6), same shapes.
  - `proxy-30b`: a ~30B-total / ~3B-active proxy with the same structure, for pod experiments.
  - `tiny`:      a few M parameters, same structure (MLA, dense first layer, routed + shared experts,
                 MTP), for CPU runs and tests.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN RoPE scaling as the DeepseekV3 checkpoints carry it in `rope_scaling`."""

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 1.0

  def __post_init__(self):
    if self.factor < 1.0:
      raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
    if self.original_max_position_embeddings <= 0:
      raise ValueError("rope_scaling.original_max_position_embeddings must be positive")
    if self.beta_fast < self.beta_slow:
      raise ValueError(
          f"rope_scaling.beta_fast ({self.beta_fast}) must be >= beta_slow ({self.beta_slow})")


# Implementation choices that do not change the function the model computes (up to numerics).
GMM_IMPLS = ("auto", "ragged_dot", "dense", "pallas")
GMM_FORMATS = ("bf16", "fp8", "mxfp8", "nvfp4")
A2A_IMPLS = ("auto", "ragged", "padded", "ragged_emulated")
REMAT_POLICIES = ("none", "full", "save_attention", "save_wide_dots", "save_dots",
                  "offload_experts", "save_experts")  # block.py
ATTENTION_IMPLS = ("auto", "reference", "blockwise", "splash")  # see c2.ops.attention
CONTEXT_PARALLEL = ("latent_all_gather", "ulysses")  # see c2.ops.context_attention
SEQUENCE_LAYOUTS = ("natural", "zigzag")  # see c2.data.zigzag


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """DeepseekV3-family decoder with MLA attention, sigmoid-routed MoE and MTP modules.

  Field names follow the Hugging Face config where one exists (see `c2.hf.config` for the mapping).
  """

  vocab_size: int
  hidden_size: int
  num_layers: int
  first_k_dense: int  # HF first_k_dense_replace: the first k layers use a dense FFN.
  dense_ffn_size: int  # HF intermediate_size
  moe_ffn_size: int  # HF moe_intermediate_size (per expert)
  num_routed_experts: int
  num_shared_experts: int
  experts_per_token: int  # HF num_experts_per_tok (top-k)
  num_heads: int
  q_lora_rank: Optional[int]  # None: a full-rank query projection
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  n_group: int = 1
  topk_group: int = 1
  scoring_func: str = "sigmoid"
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  rope_theta: float = 10000.0
  rope_scaling: Optional[YarnScaling] = None
  max_position_embeddings: int = 4096
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  mtp_depth: int = 0  # HF num_nextn_predict_layers; 0 disables MTP.
  bos_token_id: int = 0
  eos_token_id: int = 1
  pad_token_id: Optional[int] = None
  # --- numerics and implementation (not part of the HF architecture) ---
  dtype: str = "bfloat16"  # compute dtype of activations and matmuls
  param_dtype: str = "float32"  # master weights
  remat_policy: str = "full"
  gmm_impl: str = "auto"  # grouped matmul of the routed experts
  gmm_fmt: str = "bf16"  # pallas forward format
  gmm_bwd_fmt: Optional[str] = None  # pallas backward format (None: same as forward)
  dispatch_fmt: Optional[str] = None  # "mxfp8": quantise tokens before the all-to-all
  a2a_impl: str = "auto"  # expert-parallel all-to-all
  # Expert-parallel receive buffers as a multiple of the average load; None = dropless worst case
  # (P times the average). Overflowing token-choices are dropped and counted (moe/dropped_fraction).
  ep_capacity_factor: Optional[float] = None
  attention_impl: str = "auto"  # splash on TPU; dense (T <= 2048) or blockwise elsewhere
  # Splash's backward as one kernel (c2.ops.splash_attention): fewer FLOPs, but it holds dq per
  # kv block (T^2 / block_kv): the layouts measured to fit turn it on (experiments/layouts.py).
  splash_fused_backward: bool = False
  # Splash called per chunk of query rows (each against its causal key prefix): the fused
  # backward's dq partials shrink by this factor, so long rows can keep the fused backward.
  splash_query_chunks: int = 1
  # How attention splits a row over the mesh's context axis (c2.ops.context_attention):
  # "latent_all_gather" gathers the MLA latents (Composer 2's; the pipeline then lays rows out
  # zig-zag, c2.data.zigzag) or "ulysses" all-to-alls (the default: on TPU, splash exactly as
  # before this option existed; experiments opt into the latent path until measured).
  context_parallel: str = "ulysses"
  # Row order of the batch being run: "zigzag" is set by the loss for zig-zag batches
  # (c2.data.zigzag); experiments leave it "natural".
  sequence_layout: str = "natural"
  # False: the layers as separate modules `layer_{i}` instead of one nn.scan over stacked params
  # (params converted by c2.model.unstack_layers). For decoding on CPU, where XLA copies each
  # layer's slice of the stacked weights every step; training and checkpoints use the scan.
  scan_layers: bool = True
  # Decoding with a latent cache attends over the smallest of this many nested prefixes of the
  # cache (halving from its capacity) that holds every row's cached tokens, picked per call by a
  # lax.switch: the cost follows the longest live sequence, not the capacity. 0 or 1: the whole
  # cache (the engine's choice for a mesh, where the length axis may be sharded).
  cache_windows: int = 0

  def __post_init__(self):
    def positive(name):
      if getattr(self, name) is None or getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive integer, got {getattr(self, name)}")

    for name in ("vocab_size", "hidden_size", "num_layers", "moe_ffn_size", "num_routed_experts",
                 "experts_per_token", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group"):
      positive(name)
    if not 0 <= self.first_k_dense <= self.num_layers:
      raise ValueError(f"ModelConfig.first_k_dense={self.first_k_dense} must be in [0, num_layers]")
    if self.first_k_dense > 0:
      positive("dense_ffn_size")
    if self.q_lora_rank is not None:
      positive("q_lora_rank")
    if self.qk_rope_head_dim % 2:
      raise ValueError("ModelConfig.qk_rope_head_dim must be even (RoPE rotates pairs)")
    if self.experts_per_token > self.num_routed_experts:
      raise ValueError(
          f"ModelConfig.experts_per_token={self.experts_per_token} exceeds "
          f"num_routed_experts={self.num_routed_experts}")
    if self.num_routed_experts % self.n_group:
      raise ValueError(f"ModelConfig.num_routed_experts must be divisible by n_group={self.n_group}")
    if self.topk_group > self.n_group:
      raise ValueError("ModelConfig.topk_group must be <= n_group")
    if self.n_group > 1 and self.num_routed_experts // self.n_group < 2:
      raise ValueError("group-limited routing scores a group by its top-2 experts: need >= 2 per group")
    if self.n_group > 1 and self.topk_group * (self.num_routed_experts // self.n_group) < \
        self.experts_per_token:
      raise ValueError("topk_group groups hold fewer experts than experts_per_token")
    if self.scoring_func != "sigmoid":
      raise ValueError(f"ModelConfig.scoring_func={self.scoring_func!r}: only 'sigmoid' is supported")
    if self.mtp_depth < 0:
      raise ValueError("ModelConfig.mtp_depth must be >= 0")
    if self.splash_query_chunks < 1:
      raise ValueError("ModelConfig.splash_query_chunks must be >= 1 (1: one splash call per row)")
    if self.ep_capacity_factor is not None and self.ep_capacity_factor < 1.0:
      raise ValueError("ModelConfig.ep_capacity_factor must be >= 1 (None: dropless worst case)")
    for name, allowed in (("gmm_impl", GMM_IMPLS), ("a2a_impl", A2A_IMPLS),
                          ("remat_policy", REMAT_POLICIES), ("attention_impl", ATTENTION_IMPLS),
                          ("context_parallel", CONTEXT_PARALLEL),
                          ("sequence_layout", SEQUENCE_LAYOUTS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; choose one of {allowed}")
    for name in ("gmm_fmt", "gmm_bwd_fmt", "dispatch_fmt"):
      value = getattr(self, name)
      if value is not None and value not in GMM_FORMATS:
        raise ValueError(f"ModelConfig.{name}={value!r}; choose one of {GMM_FORMATS}")
    if self.dtype not in ("bfloat16", "float32") or self.param_dtype not in ("bfloat16", "float32"):
      raise ValueError("ModelConfig.dtype and param_dtype must be 'bfloat16' or 'float32'")

  # --- derived sizes ---
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def num_moe_layers(self) -> int:
    return self.num_layers - self.first_k_dense

  @property
  def shared_ffn_size(self) -> int:
    return self.moe_ffn_size * self.num_shared_experts

  @property
  def softmax_scale(self) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 whenever YaRN is configured.

    This is how the reference folds YaRN's attention temperature into MLA: only 64 of the 192
    query/key dims rotate, so scaling cos/sin alone could not apply it.
    """
    scale = self.qk_head_dim ** -0.5
    if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
      m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
      scale *= m * m
    return scale

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_KIMI_SHAPE = dict(
    vocab_size=163840, hidden_size=7168, num_layers=61, first_k_dense=1, dense_ffn_size=18432,
    moe_ffn_size=2048, num_routed_experts=384, num_shared_experts=1, experts_per_token=8,
    num_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
    rope_theta=50000.0, tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163585,
)

PRESETS = {
    # Values: ../shared/research/kimi_config.md (K2.5 text_config; K2-Instruct 0711).
    "kimi-k2.5": ModelConfig(
        **_KIMI_SHAPE, rms_norm_eps=1e-5, max_position_embeddings=262144, pad_token_id=163839,
        rope_scaling=YarnScaling(factor=64.0, original_max_position_embeddings=4096,
                                 beta_fast=32.0, beta_slow=1.0), mtp_depth=1),
    "kimi-k2": ModelConfig(
        **_KIMI_SHAPE, rms_norm_eps=1e-6, max_position_embeddings=131072,
        rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096,
                                 beta_fast=1.0, beta_slow=1.0), mtp_depth=1),
    # ~30B total / ~3B active: same structure at 1/2 width, 1/2 depth, 128 experts.
    "proxy-30b": ModelConfig(
        vocab_size=163840, hidden_size=3072, num_layers=24, first_k_dense=1, dense_ffn_size=8192,
        moe_ffn_size=1024, num_routed_experts=128, num_shared_experts=1, experts_per_token=8,
        num_heads=24, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, routed_scaling_factor=2.827, rope_theta=50000.0, rms_norm_eps=1e-5,
        max_position_embeddings=262144, bos_token_id=163584, eos_token_id=163585,
        rope_scaling=YarnScaling(factor=64.0, original_max_position_embeddings=4096),
        mtp_depth=1),
    "tiny": ModelConfig(
        vocab_size=4096, hidden_size=256, num_layers=4, first_k_dense=1, dense_ffn_size=512,
        moe_ffn_size=128, num_routed_experts=8, num_shared_experts=1, experts_per_token=2,
        num_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, routed_scaling_factor=2.827, rope_theta=50000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, bos_token_id=0, eos_token_id=1,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=2048),
        mtp_depth=1, remat_policy="none"),  # memory is no issue at this size; speed is
}


def get_preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
