"""Hugging Face `config.json` <-> `ModelConfig`, and `ModelConfig` <-> our own JSON.

Reads the DeepseekV3 text config as the published checkpoints carry it (Kimi-K2 `rope_scaling`
with `rope_theta` beside it; Kimi-K2.5 nests it under `text_config`) and as transformers 5 writes
it (`rope_parameters` with `rope_theta` inside). Writes the published DeepseekV3 form, which
transformers 4/5, vLLM and SGLang all read. Anything the model cannot represent is refused with
an error that names the field and the fix, instead of being converted into a different model.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any, Optional

from c2.model.config import ModelConfig, YarnScaling, yarn_mscale

log = logging.getLogger(__name__)

# HF DeepseekV3 field -> ModelConfig field, for the fields that map one to one.
_RENAMES = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "first_k_dense_replace": "first_k_dense", "intermediate_size": "dense_ffn_size",
    "moe_intermediate_size": "moe_ffn_size", "n_routed_experts": "num_routed_experts",
    "n_shared_experts": "num_shared_experts", "num_experts_per_tok": "experts_per_token",
    "num_attention_heads": "num_heads", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "n_group": "n_group",
    "topk_group": "topk_group", "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "routed_scaling_factor",
    "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings", "num_nextn_predict_layers": "mtp_depth",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "moe_intermediate_size",
             "n_routed_experts", "num_experts_per_tok", "num_attention_heads", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Fields that must have one value (HF default when absent), or the model computes something else.
_FIXED = {
    "scoring_func": ("sigmoid", "sigmoid"), "topk_method": ("noaux_tc", "noaux_tc"),
    "moe_layer_freq": (1, 1), "hidden_act": ("silu", "silu"), "attention_bias": (False, False),
    "rope_interleave": (True, True),
}


class HFConfigError(ValueError):
  """A config.json this converter cannot represent faithfully."""


def text_config(raw: dict) -> tuple[dict, dict]:
  """Returns (text config, top-level config); Kimi-K2.5 nests the LM config under text_config."""
  if "text_config" in raw:
    text = dict(raw["text_config"])
    for key in ("tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id"):
      if key not in text and key in raw:
        text[key] = raw[key]
    return text, raw
  return raw, raw


def _yarn_from_hf(rope: dict, max_positions: int, where: str) -> Optional[YarnScaling]:
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind == "default":
    return None
  if kind != "yarn":
    raise HFConfigError(f"{where}: rope type {kind!r} is not supported; the model implements "
                        "only YaRN (DeepseekV3 'yarn') or plain RoPE")
  if rope.get("truncate", True) is not True:
    raise HFConfigError(f"{where}.truncate=false is not supported (the model floors/ceils the "
                        "YaRN correction range); remove it or set it to true")
  original = rope.get("original_max_position_embeddings")
  if original is None:
    raise HFConfigError(f"{where}.original_max_position_embeddings is missing; add the "
                        "pretraining context length (4096 for the Kimi checkpoints)")
  factor = rope.get("factor") or max_positions / original
  # HF semantics: a missing mscale/mscale_all_dim disables that term (0 here, not our default 1).
  yarn = YarnScaling(factor=float(factor), original_max_position_embeddings=int(original),
                     beta_fast=float(rope.get("beta_fast") or 32.0),
                     beta_slow=float(rope.get("beta_slow") or 1.0),
                     mscale=float(rope.get("mscale") or 0.0),
                     mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
  if rope.get("attention_factor") is not None:
    expected = (yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
                if yarn.mscale and yarn.mscale_all_dim else yarn_mscale(yarn.factor))
    if not math.isclose(rope["attention_factor"], expected, rel_tol=1e-6):
      raise HFConfigError(f"{where}.attention_factor={rope['attention_factor']} differs from the "
                          f"value implied by factor/mscale ({expected}); remove it")
  return yarn


def declared_compute_dtype(raw: dict) -> str | None:
  """The compute dtype config.json declares: 'float32' for a float32 checkpoint, 'bfloat16' for
  bf16 / fp16 / the quantised releases; None when it declares none. Read from `dtype`
  (`torch_dtype` before transformers 4.56), at the top or in Kimi-K2.5's text_config."""
  text = raw.get("text_config") or {}
  declared = (raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype")
              or text.get("torch_dtype"))
  if declared is None:
    return None
  return "float32" if str(declared).removeprefix("torch.") == "float32" else "bfloat16"


def from_hf_dict(raw: dict, *, source: str = "config.json", **overrides) -> ModelConfig:
  """An HF DeepseekV3 / Kimi config dict -> ModelConfig (overrides: extra ModelConfig fields).
  The config computes in the dtype the checkpoint declares (float32 stays float32)."""
  cfg, _ = text_config(raw)
  missing = [k for k in _REQUIRED if cfg.get(k) is None]
  if missing:
    raise HFConfigError(f"{source}: missing required field(s) {missing}; is this a DeepseekV3 / "
                        "Kimi-K2 config? (Kimi-K2.5 keeps them under 'text_config')")
  for key, (default, required) in _FIXED.items():
    value = cfg.get(key, default)
    if value is None:
      value = default
    if value != required:
      raise HFConfigError(f"{source}: {key}={value!r} is not supported; the model implements "
                          f"{key}={required!r} only")
  kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
  if kv_heads != cfg["num_attention_heads"]:
    raise HFConfigError(f"{source}: num_key_value_heads={kv_heads} differs from "
                        f"num_attention_heads={cfg['num_attention_heads']}; MLA expands one latent "
                        "to every head, so set num_key_value_heads = num_attention_heads")
  fields = {ours: cfg[hf] for hf, ours in _RENAMES.items() if cfg.get(hf) is not None}
  fields.setdefault("q_lora_rank", None)
  fields.setdefault("first_k_dense", 0)
  fields.setdefault("num_shared_experts", 0)
  fields.setdefault("dense_ffn_size", cfg.get("intermediate_size") or 0)
  if isinstance(fields.get("eos_token_id"), list):
    eos = fields["eos_token_id"]
    log.warning("%s: eos_token_id is a list %s; keeping the first", source, eos)
    fields["eos_token_id"] = eos[0]
  if fields.get("q_lora_rank") == 0:
    fields["q_lora_rank"] = None

  rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
  where = f"{source}: " + ("rope_parameters" if cfg.get("rope_parameters") else "rope_scaling")
  theta = cfg.get("rope_theta", rope.get("rope_theta"))
  if theta is None:
    raise HFConfigError(f"{source}: rope_theta is missing (top level or inside rope_parameters)")
  fields["rope_theta"] = float(theta)
  fields["rope_scaling"] = _yarn_from_hf(rope, cfg.get("max_position_embeddings", 4096), where)
  fields["dtype"] = declared_compute_dtype(raw) or "bfloat16"
  fields.update(overrides)
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise HFConfigError(f"{source}: {e}") from e


def to_hf_dict(cfg: ModelConfig, *, torch_dtype: str = "bfloat16") -> dict:
  """ModelConfig -> config.json of a DeepseekV3ForCausalLM (the published Kimi-K2 layout)."""
  out: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
  for hf, ours in _RENAMES.items():
    out[hf] = getattr(cfg, ours)
  out["first_k_dense_replace"] = cfg.first_k_dense
  out["num_key_value_heads"] = cfg.num_heads
  out.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, hidden_act="silu",
             attention_bias=False, attention_dropout=0.0, rope_interleave=True,
             rope_theta=cfg.rope_theta, torch_dtype=torch_dtype, initializer_range=0.02,
             use_cache=True)
  yarn = cfg.rope_scaling
  out["rope_scaling"] = None if yarn is None else {
      "type": "yarn", "rope_type": "yarn", "factor": yarn.factor,
      "original_max_position_embeddings": yarn.original_max_position_embeddings,
      "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "mscale": yarn.mscale,
      "mscale_all_dim": yarn.mscale_all_dim}
  return out


def load_hf_config(path: str, **overrides) -> ModelConfig:
  with open(path) as f:
    return from_hf_dict(json.load(f), source=path, **overrides)


# --- our own serialisation (saved beside orbax params by c2.hf.convert) ---

def to_json(cfg: ModelConfig) -> str:
  return json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True)


def from_json(text: str) -> ModelConfig:
  fields = json.loads(text)
  if fields.get("rope_scaling") is not None:
    fields["rope_scaling"] = YarnScaling(**fields["rope_scaling"])
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"model config JSON has unknown field(s) {unknown}")
  return ModelConfig(**fields)
