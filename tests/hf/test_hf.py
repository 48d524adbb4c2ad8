"""c2/hf: dequantisers, config mapping, logit parity with transformers' DeepseekV3, round trips.

The parity tests build tiny random `transformers.DeepseekV3ForCausalLM` models in float32 (router
and correction bias randomised: transformers initialises the router to zeros), save them with
save_pretrained, import them, and compare logits. Tolerance 1e-4 absolute on logits of size ~5:
both sides compute in float32 and land ~1e-5 apart (each is that far from a float64 run of
transformers); a mapping mistake is O(1). q_a_proj is initialised small so that q_a_layernorm's
epsilon (1e-6 in the reference, not rms_norm_eps) shows up too.
"""
import functools
import json
import logging

import jax
import ml_dtypes
import numpy as np
import pytest

from c2 import model
from c2.hf import checkpoint as hf
from c2.hf import config as hf_config
from c2.hf.tensors import ShardedWriter, TensorStore, dequantize_fp8_block, dequantize_int4
from c2.model.config import ModelConfig, YarnScaling, get_preset

TOL = 1e-4

# --- dequantisers -------------------------------------------------------------------------------


def pack_int4(q: np.ndarray) -> np.ndarray:
  """int [O, I] in [-8, 7] -> int32 [O, I/8], value + 8 as nibbles, lowest nibble first."""
  o, i = q.shape
  nibbles = (q + 8).astype(np.uint32).reshape(o, i // 8, 8)
  return np.bitwise_or.reduce(nibbles << (np.arange(8, dtype=np.uint32) * 4), axis=-1).view(np.int32)


def quantize_int4(w: np.ndarray, group: int = 32):
  """Symmetric per-group INT4 as compressed-tensors does it: scale = max|w| / 7 (stored bf16)."""
  o, i = w.shape
  scale = (np.abs(w).reshape(o, i // group, group).max(-1) / 7).astype(ml_dtypes.bfloat16)
  full = np.repeat(scale.astype(np.float32), group, axis=1)
  q = np.clip(np.round(w / full), -8, 7).astype(np.int32)
  return pack_int4(q), scale, (q * full).astype(np.float32)


def quantize_fp8(w: np.ndarray, block: int = 128):
  """Block FP8 e4m3 as DeepSeek/Kimi store it: scale_inv = amax / 448 per 128x128 block."""
  o, i = w.shape
  bo, bi = -(-o // block), -(-i // block)
  padded = np.zeros((bo * block, bi * block), np.float32)
  padded[:o, :i] = w
  amax = np.abs(padded.reshape(bo, block, bi, block)).max(axis=(1, 3))
  scale_inv = np.maximum(amax, 1e-12) / 448.0
  full = np.repeat(np.repeat(scale_inv, block, 0), block, 1)[:o, :i]
  q = (w / full).astype(ml_dtypes.float8_e4m3fn)
  return q, scale_inv.astype(np.float32), q.astype(np.float32) * full


def test_int4_hand_example():
  # Word 0 holds nibbles 0..7 (lowest first) -> values -8..-1; word 1 nibbles 8..15 -> 0..7.
  packed = np.array([[0x76543210, 0xFEDCBA98, 0x88888888, 0x88888888,  # group 0, scale 2
                      0x00000009, 0x88888888, 0x88888888, 0xF8888888]], np.uint32).view(np.int32)
  scale = np.array([[2.0, 0.5]], ml_dtypes.bfloat16)
  got = dequantize_int4(packed, scale, (1, 64))
  expected = np.zeros(64, np.float32)
  expected[:16] = 2.0 * np.arange(-8, 8)
  expected[32:40] = 0.5 * np.array([1, -8, -8, -8, -8, -8, -8, -8])
  expected[63] = 0.5 * 7
  np.testing.assert_array_equal(got[0], expected)


def test_int4_random_matrix():
  w = np.random.RandomState(0).randn(12, 96).astype(np.float32)
  packed, scale, expected = quantize_int4(w)
  got = dequantize_int4(packed, scale, w.shape)
  np.testing.assert_array_equal(got, expected)
  half_step = np.repeat(scale.astype(np.float32), 32, axis=1) / 2
  assert np.all(np.abs(got - w) <= half_step * 1.01)


def test_fp8_hand_example_with_partial_edge_blocks():
  weight = np.ones((130, 260), ml_dtypes.float8_e4m3fn)
  weight[129, 259] = 1.5
  scale_inv = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
  got = dequantize_fp8_block(weight, scale_inv)
  assert got.shape == (130, 260)
  assert (got[0, 0], got[127, 127], got[0, 128], got[0, 256], got[128, 0], got[129, 255]) == (
      1, 1, 2, 3, 4, 5)
  assert got[129, 259] == 1.5 * 6


def test_fp8_random_matrix():
  w = np.random.RandomState(1).randn(200, 300).astype(np.float32)
  q, scale_inv, expected = quantize_fp8(w)
  assert scale_inv.shape == (2, 3)
  got = dequantize_fp8_block(q, scale_inv)
  np.testing.assert_array_equal(got, expected)
  np.testing.assert_allclose(got, w, rtol=2 ** -3, atol=np.abs(w).max() / 448 * 2 ** -6)


# --- config mapping -----------------------------------------------------------------------------

K25_CONFIG = {  # the published Kimi-K2.5 config.json, abridged to the LM fields
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "pad_token_id": 163839, "tie_word_embeddings": False, "vision_config": {"hidden_size": 1152},
    "text_config": {
        "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
        "n_routed_experts": 384, "num_experts_per_tok": 8, "routed_scaling_factor": 2.827,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "hidden_act": "silu", "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "bos_token_id": 163584,
        "eos_token_id": 163585, "pad_token_id": 163839, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False, "attention_bias": False,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0}}}


def test_kimi_k25_config_maps_to_preset():
  assert hf_config.from_hf_dict(K25_CONFIG) == get_preset("kimi-k2.5", mtp_depth=0)
  back = hf_config.from_hf_dict(hf_config.to_hf_dict(get_preset("kimi-k2")))
  assert back == get_preset("kimi-k2")
  assert hf_config.from_json(hf_config.to_json(get_preset("tiny"))) == get_preset("tiny")


def test_rope_parameters_form_and_missing_mscale():
  text = dict(K25_CONFIG["text_config"])
  del text["rope_scaling"], text["rope_theta"]
  text["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                             "original_max_position_embeddings": 4096}
  cfg = hf_config.from_hf_dict(text)
  # transformers semantics: absent mscale_all_dim -> no softmax temperature, default betas.
  assert cfg.rope_scaling == YarnScaling(64.0, 4096, 32.0, 1.0, 0.0, 0.0)
  assert cfg.softmax_scale == cfg.qk_head_dim ** -0.5


@pytest.mark.parametrize("field,value,message", [
    ("num_key_value_heads", 8, "num_key_value_heads"),
    ("scoring_func", "softmax", "scoring_func"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope type 'linear'"),
    ("hidden_size", None, "hidden_size"),
])
def test_config_errors_name_the_field(field, value, message):
  text = dict(K25_CONFIG["text_config"], **{field: value})
  with pytest.raises(hf_config.HFConfigError, match=message):
    hf_config.from_hf_dict(text)


# --- parity with transformers -------------------------------------------------------------------

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
             routed_scaling_factor=2.827, n_group=1, topk_group=1, first_k_dense_replace=1,
             norm_topk_prob=True, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16,
             qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024,
             rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
CONFIGS = {
    # K2.5-like YaRN (beta_fast 32), grouped routing with topk_group < n_group, q_lora.
    "k25_yarn_grouped": dict(n_group=2, topk_group=1, rope_scaling=dict(
        type="yarn", factor=4.0, original_max_position_embeddings=256, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    # K2-like YaRN (beta 1/1), two dense layers, full-rank queries, tied embeddings.
    "k2_yarn_dense2": dict(first_k_dense_replace=2, q_lora_rank=None, tie_word_embeddings=True,
                           rms_norm_eps=1e-6, rope_scaling=dict(
                               type="yarn", factor=8.0, original_max_position_embeddings=128,
                               beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    # Plain RoPE, 4 groups keep 2, top-2.
    "rope_grouped4": dict(n_group=4, topk_group=2, num_experts_per_tok=2),
}
T = 24


@functools.lru_cache(maxsize=None)
def _torch_model(name: str):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = transformers.DeepseekV3Config(**{**_BASE, **CONFIGS[name]}, attn_implementation="eager")
  torch.manual_seed(0)
  m = transformers.DeepseekV3ForCausalLM(config).eval()
  with torch.no_grad():  # O(1) activations everywhere, so the tolerance means something
    for pname, p in m.named_parameters():
      if p.ndim == 1:
        p.copy_(1 + 0.2 * torch.randn_like(p))  # every norm scale
      elif "q_a_proj" in pname:  # a small latent (mean square ~1e-3) makes its norm's eps visible
        p.normal_(0, 0.03 * p.shape[-1] ** -0.5)
      elif "embed_tokens" in pname:
        p.normal_(0, 0.2)  # logits stay O(1) with tied embeddings too
      else:  # Linear [out, in], fused experts [E, out, in], router [E, D]
        p.normal_(0, p.shape[-1] ** -0.5)
    for bname, b in m.named_buffers():
      if "e_score_correction_bias" in bname:
        b.copy_(0.1 * torch.randn_like(b))
  return m


def _torch_logits(m, tokens):
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    return m(torch.tensor(tokens)).logits.numpy()


@functools.lru_cache(maxsize=None)
def _jax_logits_fn(cfg: ModelConfig, segmented: bool):
  # The imported config is used as it comes (a float32 checkpoint computes in float32); only the
  # remat policy, which changes no value, is dropped to compile faster.
  cfg = cfg.replace(remat_policy="none")
  if segmented:
    return jax.jit(lambda p, t, s, pos: model.logits(cfg, p, t, segment_ids=s, positions=pos))
  return jax.jit(lambda p, t: model.logits(cfg, p, t))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """name -> (torch model, checkpoint dir, ModelConfig, params)."""
  cache = {}

  def get(name):
    if name not in cache:
      m = _torch_model(name)
      path = tmp_path_factory.mktemp(name)
      m.save_pretrained(path, safe_serialization=True)
      cfg, params = hf.import_checkpoint(str(path))
      cache[name] = (m, path, cfg, params)
    return cache[name]

  return get


def _tokens(seed: int = 0, batch: int = 2):
  return np.random.RandomState(seed).randint(0, _BASE["vocab_size"], (batch, T)).astype(np.int32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, imported):
  m, _, cfg, params = imported(name)
  assert cfg.mtp_depth == 0 and cfg.num_layers == 3  # transformers saves no MTP weights
  assert cfg.dtype == "float32"  # the float32 reference computes in float32, and so do we
  tokens = _tokens()
  want = _torch_logits(m, tokens)
  got = np.asarray(_jax_logits_fn(cfg, False)(params, tokens))
  diff = float(np.abs(got - want).max())
  print(f"{name}: max |logit diff| = {diff:.2e} (max |logit| {np.abs(want).max():.2f})")
  assert diff <= TOL


def test_packed_segments_match_separate_documents(imported):
  m, _, cfg, params = imported("k25_yarn_grouped")
  split = 10
  row = _tokens(seed=3, batch=1)
  segment_ids = np.array([[1] * split + [2] * (T - split)], np.int32)
  positions = np.array([list(range(split)) + list(range(T - split))], np.int32)
  got = np.asarray(_jax_logits_fn(cfg, True)(params, row, segment_ids, positions))[0]
  want = np.concatenate([_torch_logits(m, row[:, :split])[0], _torch_logits(m, row[:, split:])[0]])
  diff = float(np.abs(got - want).max())
  print(f"packed segments: max |logit diff| = {diff:.2e}")
  assert diff <= TOL


def test_export_loads_in_transformers(imported, tmp_path):
  transformers = pytest.importorskip("transformers")
  m, _, cfg, params = imported("k25_yarn_grouped")
  hf.export_checkpoint(cfg, params, str(tmp_path), dtype="float32", max_shard_bytes=200_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1  # really sharded
  reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager", dtype="float32").eval()
  tokens = _tokens(seed=5)
  diff = float(np.abs(_torch_logits(reloaded, tokens) - _torch_logits(m, tokens)).max())
  print(f"export -> transformers: max |logit diff| = {diff:.2e}")
  assert diff <= 1e-6


def _write_variant(src_dir, out_dir, rename, transform, config_edit):
  """Rewrites a checkpoint tensor by tensor: transform(name, float32 array) -> {name: array}."""
  store = TensorStore(str(src_dir))
  writer = ShardedWriter(str(out_dir))
  for name in store.names():
    for new_name, array in transform(name, store.read(name).astype(np.float32)).items():
      writer.add(rename(new_name), array)
  writer.close()
  raw = json.loads((src_dir / "config.json").read_text())
  (out_dir / "config.json").write_text(json.dumps(config_edit(raw)))


def _assert_same_params(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_quantized_kimi_layouts_import_dequantized(imported, tmp_path):
  """K2.5 layout (text_config, `language_model.` prefix, vision tensors, INT4 experts) and K2
  layout (block FP8 linears): importing them equals importing the dequantised weights."""
  _, src, _, _ = imported("k25_yarn_grouped")
  plain, k25, k2 = tmp_path / "plain", tmp_path / "k25", tmp_path / "k2"
  for d in (plain, k25, k2):
    d.mkdir()
  stored = {}  # name -> {quantised name: array}, dequantised copy in `plain`

  def quantise(name, w):
    module = name[:-len(".weight")]
    if ".experts." in name:  # INT4, group 32 along the input dim
      packed, scale, deq = quantize_int4(w)
      stored[name] = {f"{module}.weight_packed": packed, f"{module}.weight_scale": scale,
                      f"{module}.weight_shape": np.array(w.shape, np.int32)}
    elif w.ndim == 2 and not any(k in name for k in ("embed", "lm_head", "mlp.gate.weight")):
      q, scale_inv, deq = quantize_fp8(w)  # block FP8, as every other K2 Linear
      stored[name] = {name: q, f"{module}.weight_scale_inv": scale_inv}
    else:
      stored[name], deq = {name: w}, w
    return {name: deq}

  _write_variant(src, plain, lambda n: n, quantise, lambda c: c)
  k25_text = lambda c: {"model_type": "kimi_k25", "text_config": dict(c, quantization_config={
      "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
          "group_0": {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                  "strategy": "group", "group_size": 32}}}})}
  def k25_tensors(name, w):
    out = stored[name] if ".experts." in name else {name: w}
    if name == "model.norm.weight":  # the vision tower rides along and must be ignored
      out = dict(out, **{"vision_tower.patch_embed.weight": w[None]})
    return out

  k25_name = lambda n: n if n.startswith("vision_tower.") else "language_model." + n
  _write_variant(plain, k25, k25_name, k25_tensors, k25_text)
  fp8_config = lambda c: dict(c, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                      "weight_block_size": [128, 128]})
  _write_variant(plain, k2, lambda n: n, lambda n, w: {n: w} if ".experts." in n else stored[n],
                 fp8_config)

  _, want = hf.import_checkpoint(str(plain))
  _assert_same_params(hf.import_checkpoint(str(k25))[1], want)
  _assert_same_params(hf.import_checkpoint(str(k2))[1], want)


# --- round trips of our params (MTP included) ---------------------------------------------------

def _random_params(cfg: ModelConfig, seed: int = 0):
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda a: rng.randn(*a.shape).astype(np.float32),
                      model.abstract_params(cfg))


@pytest.mark.parametrize("overrides", [
    dict(mtp_depth=2),
    dict(mtp_depth=1, q_lora_rank=None, tie_word_embeddings=True, first_k_dense=4, rope_scaling=None),
], ids=["mtp2_moe", "mtp1_dense_tied"])
def test_export_import_round_trip_with_mtp(overrides, tmp_path):
  cfg = get_preset("tiny", vocab_size=512, **overrides)
  params = _random_params(cfg)
  hf.export_checkpoint(cfg, params, str(tmp_path / "f32"), dtype="float32")
  got_cfg, got = hf.import_checkpoint(str(tmp_path / "f32"))
  # Implementation choices (remat, kernels) are not part of an HF checkpoint; a float32 one
  # computes in float32 once imported (the tiny preset computes in bfloat16).
  assert cfg.dtype == "bfloat16" and got_cfg.dtype == "float32"
  assert got_cfg == cfg.replace(remat_policy=got_cfg.remat_policy, dtype="float32")
  assert "mtp_0" in got
  _assert_same_params(got, params)
  told = hf.import_checkpoint(str(tmp_path / "f32"), compute_dtype="bfloat16")[0]
  assert told.dtype == "bfloat16"  # unless told otherwise
  hf.export_checkpoint(cfg, params, str(tmp_path / "bf16"), dtype="bfloat16")
  cfg16, got16 = hf.import_checkpoint(str(tmp_path / "bf16"), dtype=ml_dtypes.bfloat16)
  assert cfg16.dtype == "bfloat16"
  bias = lambda path, x: "correction_bias" in jax.tree_util.keystr(path)
  want16 = jax.tree_util.tree_map_with_path(
      lambda p, x: x if bias(p, x) else x.astype(ml_dtypes.bfloat16), params)
  _assert_same_params(got16, want16)


def test_fused_expert_layout(imported, tmp_path):
  """transformers' in-memory layout mlp.experts.gate_up_proj [E, 2F, D] / down_proj [E, D, F]."""
  _, src, cfg, params = imported("rope_grouped4")
  store, writer = TensorStore(str(src)), ShardedWriter(str(tmp_path))
  for name in store.names():
    if ".experts." not in name:
      writer.add(name, store.read(name))
  for layer in range(cfg.first_k_dense, cfg.num_layers):
    prefix = f"model.layers.{layer}.mlp.experts."
    w = lambda e, proj: store.read(f"{prefix}{e}.{proj}.weight")
    experts = range(cfg.num_routed_experts)
    writer.add(prefix + "gate_up_proj",
               np.stack([np.concatenate([w(e, "gate_proj"), w(e, "up_proj")]) for e in experts]))
    writer.add(prefix + "down_proj", np.stack([w(e, "down_proj") for e in experts]))
  writer.close()
  (tmp_path / "config.json").write_text((src / "config.json").read_text())
  _assert_same_params(hf.import_checkpoint(str(tmp_path))[1], params)


def test_unmapped_tensors_are_an_error(imported, tmp_path):
  _, src, _, _ = imported("rope_grouped4")
  _write_variant(src, tmp_path, lambda n: n,
                 lambda n, w: {n: w, n.replace(".o_proj.", ".o_proj_extra."): w}
                 if ".o_proj." in n else {n: w}, lambda c: c)
  with pytest.raises(ValueError, match="not mapped"):
    hf.import_checkpoint(str(tmp_path))


def test_missing_mtp_weights_drop_depth_with_warning(imported, caplog):
  _, src, _, _ = imported("rope_grouped4")
  with caplog.at_level(logging.WARNING):
    cfg, params = hf.import_checkpoint(str(src))
  assert cfg.mtp_depth == 0 and "mtp_0" not in params
  assert "num_nextn_predict_layers=1" in caplog.text


def test_cli_import_then_export_reproduces_every_tensor(imported, tmp_path):
  from c2.hf import convert as convert_hf  # pylint: disable=import-outside-toplevel
  _, src, cfg, _ = imported("k2_yarn_dense2")
  convert_hf.main(["import", str(src), str(tmp_path / "c2")])
  convert_hf.main(["export", str(tmp_path / "c2"), str(tmp_path / "hf"), "--dtype", "float32"])
  before, after = TensorStore(str(src)), TensorStore(str(tmp_path / "hf"))
  assert sorted(before.names()) == sorted(after.names())
  for name in before.names():
    np.testing.assert_array_equal(after.read(name), before.read(name), err_msg=name)
  assert hf_config.load_hf_config(str(tmp_path / "hf" / "config.json")) == cfg
