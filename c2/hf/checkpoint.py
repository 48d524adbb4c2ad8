"""Import / export of Hugging Face DeepseekV3-layout checkpoints (Kimi-K2, Kimi-K2.5, DeepSeek-V3).

  import_checkpoint(hf_dir, dtype=np.float32) -> (ModelConfig, params)   host numpy arrays;
      the config computes in the checkpoint's dtype (float32 stays float32) unless compute_dtype
  export_checkpoint(cfg, params, out_dir, dtype="bfloat16")              config.json + shards

Glossary: D model width, V vocabulary, H heads, Q q_lora_rank, L kv_lora_rank, N/R/J the
nope/rope/value head dims, F FFN width, E routed experts, O/I a Linear's out/in features.

Mapping (HF Linear weights are [O, I]; ours are [I..., O...], so transpose then reshape):
  embed/embedding [V, D]      model.embed_tokens.weight
  lm_head [D, V]              lm_head.weight^T                    (absent when tied)
  final_norm/scale            model.norm.weight
  dense_layers/block/*[i]     model.layers.{i}.*                  i < first_k_dense
  moe_layers/block/*[i]       model.layers.{first_k_dense + i}.*
  mtp_{j}/{enorm,hnorm,head_norm,eh_proj}, mtp_{j}/block/*
                              model.layers.{num_layers + j}.{enorm,hnorm,shared_head.norm,eh_proj}, .*
The MTP layer's embed_tokens / shared_head.head duplicate the shared ones: skipped on import,
written on export. Block leaves are listed in `_BLOCK` and `_EXPERTS` below.

Memory: the single-host importer allocates each leaf once and fills it tensor by tensor, so
beyond the output it holds one source tensor; c2.hf.sharded imports into sharded jax.Arrays
without ever holding the model on one host. The exporter takes numpy or sharded jax.Arrays and
holds one layer (one expert for routed experts) of one leaf plus one output tensor at a time.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator

import jax
import ml_dtypes
import numpy as np

from c2.hf import config as hf_config
from c2 import model as model_lib
from c2.hf.progress import progress_bar
from c2.hf.gather import host_slice
from c2.hf.tensors import (INT4_QUANTIZATION_CONFIG, CheckpointError, ShardedWriter,
                              TensorStore, quantize_int4)
from c2.model.config import ModelConfig

log = logging.getLogger(__name__)
Params = Any

# Our block leaf -> (HF name under the layer, number of leading *input* dims of our leaf).
# None: a vector copied as is. An int k: a Linear `<name>.weight` [O, I] with I = prod(shape[:k]).
_BLOCK = {
    ("attn_norm", "scale"): ("input_layernorm.weight", None),
    ("ffn_norm", "scale"): ("post_attention_layernorm.weight", None),
    ("attn", "q"): ("self_attn.q_proj", 1),  # [D, H, N+R]       (q_lora_rank None)
    ("attn", "q_a"): ("self_attn.q_a_proj", 1),  # [D, Q]
    ("attn", "q_a_norm", "scale"): ("self_attn.q_a_layernorm.weight", None),
    ("attn", "q_b"): ("self_attn.q_b_proj", 1),  # [Q, H, N+R]
    ("attn", "kv_a"): ("self_attn.kv_a_proj_with_mqa", 1),  # [D, L+R]
    ("attn", "kv_a_norm", "scale"): ("self_attn.kv_a_layernorm.weight", None),
    ("attn", "kv_b"): ("self_attn.kv_b_proj", 1),  # [L, H, N+J]
    ("attn", "out"): ("self_attn.o_proj", 2),  # [H, J, D]
    ("mlp", "gate"): ("mlp.gate_proj", 1),  # [D, F]
    ("mlp", "up"): ("mlp.up_proj", 1),
    ("mlp", "down"): ("mlp.down_proj", 1),  # [F, D]
    ("moe", "router"): ("mlp.gate", 1),  # [D, E]
    ("moe", "correction_bias"): ("mlp.gate.e_score_correction_bias", None),  # [E]
    ("moe", "shared", "gate"): ("mlp.shared_experts.gate_proj", 1),
    ("moe", "shared", "up"): ("mlp.shared_experts.up_proj", 1),
    ("moe", "shared", "down"): ("mlp.shared_experts.down_proj", 1),
}
# Routed experts: [E, D, F] (gate, up) / [E, F, D] (down) <- mlp.experts.{e}.<proj>.weight^T.
_EXPERTS = {("moe", "gate"): "gate_proj", ("moe", "up"): "up_proj", ("moe", "down"): "down_proj"}
_MTP = {
    ("enorm", "scale"): ("enorm.weight", None), ("hnorm", "scale"): ("hnorm.weight", None),
    ("head_norm", "scale"): ("shared_head.norm.weight", None), ("eh_proj",): ("eh_proj", 1),
}
_TOP = {
    ("embed", "embedding"): ("model.embed_tokens.weight", None),
    ("final_norm", "scale"): ("model.norm.weight", None),
    ("lm_head",): ("lm_head", 1),
}
_FLOAT32_ALWAYS = {("moe", "router"), ("moe", "correction_bias")}  # HF keeps these in fp32
_NOT_WEIGHTS = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


def _layer_plan(cfg: ModelConfig, path: tuple[str, ...]) -> tuple[list[str], tuple, bool]:
  """Our leaf path -> (HF name prefixes, one per stacked slice; leaf key; stacked?)."""
  head = path[0]
  if head in ("dense_layers", "moe_layers"):
    first, count = (0, cfg.first_k_dense) if head == "dense_layers" else (
        cfg.first_k_dense, cfg.num_moe_layers)
    return [f"model.layers.{first + i}." for i in range(count)], path[2:], True
  if head.startswith("mtp_"):
    prefix = f"model.layers.{cfg.num_layers + int(head[4:])}."
    return [prefix], path[2:] if path[1] == "block" else path[1:], False
  return [""], path, False


def _spec(path: tuple[str, ...], key: tuple) -> tuple[str, Any]:
  if path in _TOP:
    return _TOP[path]
  if path[0].startswith("mtp_") and path[1] != "block":
    return _MTP[key]
  if key in _EXPERTS:
    return _EXPERTS[key], "experts"
  if key not in _BLOCK:
    raise KeyError(f"no HF mapping for parameter {'/'.join(path)}")
  return _BLOCK[key]


def _leaves(tree) -> Iterator[tuple[tuple[str, ...], Any]]:
  for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    yield tuple(k.key for k in keys), leaf


def set_leaf(tree: dict, path: tuple[str, ...], value: Any) -> None:
  """tree[path[0]][path[1]]...[path[-1]] = value, making the nested dicts on the way (the
  inverse of _leaves, for importers that produce one leaf at a time)."""
  for name in path[:-1]:
    tree = tree.setdefault(name, {})
  tree[path[-1]] = value


def _split(shape: tuple[int, ...], in_dims: int) -> tuple[int, int]:
  """(O, I) of the HF Linear behind one of our leaves (one slice of it)."""
  return int(np.prod(shape[in_dims:])), int(np.prod(shape[:in_dims]))


def _read_slice(store: TensorStore, prefix: str, spec, dst: np.ndarray) -> None:
  """Fills dst (our per-layer shape) from the tensors under HF name `prefix`."""
  name, kind = spec
  if kind is None:
    src = store.read(prefix + name)
    if src.shape != dst.shape:
      raise CheckpointError(f"{prefix + name}: shape {src.shape}, expected {dst.shape}; "
                            "config.json and the weights disagree")
    dst[...] = src
  elif kind == "experts":
    fused = prefix + "mlp.experts." + ("down_proj" if name == "down_proj" else "gate_up_proj")
    if fused in store:  # transformers' in-memory layout [E, 2F, D] / [E, D, F]
      w = store.read(fused).astype(np.float32)
      f = dst.shape[-1] if name != "down_proj" else dst.shape[1]
      w = {"gate_proj": w[:, :f], "up_proj": w[:, f:], "down_proj": w}[name]
      dst[...] = np.swapaxes(w, 1, 2)
    else:
      for e in range(dst.shape[0]):
        _read_slice(store, prefix, (f"mlp.experts.{e}.{name}", 1), dst[e])
  else:
    w = store.linear(prefix + name)  # [O, I] float32
    if w.shape != _split(dst.shape, kind):
      raise CheckpointError(f"{prefix + name}: [out, in] = {w.shape}, expected "
                            f"{_split(dst.shape, kind)} for our {dst.shape}; config.json and "
                            "the weights disagree")
    dst[...] = w.T.reshape(dst.shape)


def _hf_tensors(prefix: str, spec, src: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
  """Inverse of `_read_slice`: our per-layer array -> (HF name, array) pairs."""
  name, kind = spec
  if kind is None:
    yield prefix + name, src
  elif kind == "experts":
    for e in range(src.shape[0]):
      yield f"{prefix}mlp.experts.{e}.{name}.weight", src[e].T
  else:
    o, i = _split(src.shape, kind)
    yield f"{prefix}{name}.weight", src.reshape(i, o).T


def _configure_quantization(store: TensorStore, raw: dict, source: str) -> None:
  q = hf_config.text_config(raw)[0].get("quantization_config") or raw.get("quantization_config")
  if not q:
    return
  method = q.get("quant_method")
  if method == "fp8":
    store.fp8_block = tuple(q.get("weight_block_size") or (128, 128))
  elif method == "compressed-tensors":
    if q.get("format") != "pack-quantized":
      raise CheckpointError(f"{source}: compressed-tensors format {q.get('format')!r}; only "
                            "'pack-quantized' (Kimi-K2.5 INT4) is supported")
    for name, group in (q.get("config_groups") or {}).items():
      w = group.get("weights") or {}
      if (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy")) != (
          4, "int", True, "group"):
        raise CheckpointError(f"{source}: quantization group {name} is not symmetric INT4 per "
                              f"group ({w}); only the Kimi-K2.5 scheme is supported")
      store.int4_group = int(w.get("group_size", 32))
  else:
    raise CheckpointError(f"{source}: quant_method {method!r} is not supported (fp8 block or "
                          "compressed-tensors pack-quantized INT4)")


def _stored_compute_dtype(store: TensorStore, root: str) -> str:
  """For a config.json that declares no dtype: float32 when the embedding is stored in F32."""
  stored = store.dtype_name(root + "model.embed_tokens.weight")
  return "float32" if stored == "F32" else "bfloat16"


def open_checkpoint(hf_dir: str, *, dtype=np.float32, compute_dtype: str | None = None,
                    **config_overrides) -> tuple[ModelConfig, TensorStore, str]:
  """config.json + the tensor index of `hf_dir` -> (ModelConfig, TensorStore, name prefix), reading
  no weights. The config's param_dtype follows `dtype`, its compute dtype `compute_dtype` (None:
  the checkpoint's); MTP layers without weights are dropped (see import_checkpoint)."""
  config_path = os.path.join(hf_dir, "config.json")
  store = TensorStore(hf_dir)  # first: refuses a half-written export before anything else
  if not os.path.exists(config_path):
    raise CheckpointError(f"{hf_dir}: config.json not found")
  with open(config_path) as f:
    raw = json.load(f)
  dtype = np.dtype(dtype)
  if dtype not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
    raise ValueError(f"import dtype must be float32 or bfloat16, got {dtype}")
  _configure_quantization(store, raw, config_path)
  root = "language_model." if "language_model.model.embed_tokens.weight" in store else ""
  config_overrides.setdefault("param_dtype", "float32" if dtype == np.float32 else "bfloat16")
  if compute_dtype is not None:
    config_overrides["dtype"] = compute_dtype
  elif hf_config.declared_compute_dtype(raw) is None:
    config_overrides["dtype"] = _stored_compute_dtype(store, root)
  cfg = hf_config.from_hf_dict(raw, source=config_path, **config_overrides)
  present = 0
  while present < cfg.mtp_depth and \
      f"{root}model.layers.{cfg.num_layers + present}.eh_proj.weight" in store:
    present += 1
  if present < cfg.mtp_depth:
    log.warning("%s: num_nextn_predict_layers=%d but only %d MTP layer(s) have weights; "
                "importing with mtp_depth=%d", config_path, cfg.mtp_depth, present, present)
    cfg = cfg.replace(mtp_depth=present)
  check_all_mapped(store, root, cfg, hf_dir)
  return cfg, store, root


def leaf_plans(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], Any, list[str], Any, bool]]:
  """(our path, ShapeDtypeStruct, HF prefixes per stacked slice, HF spec, stacked?) per leaf."""
  for path, leaf in _leaves(model_lib.abstract_params(cfg)):
    prefixes, key, stacked = _layer_plan(cfg, path)
    yield path, leaf, prefixes, _spec(path, key), stacked


def import_dtype(path: tuple[str, ...], dtype) -> np.dtype:
  """The imported dtype of our leaf `path`: the router's correction bias stays float32."""
  return np.dtype(np.float32 if path[-1] == "correction_bias" else dtype)


def import_checkpoint(hf_dir: str, *, dtype=np.float32, compute_dtype: str | None = None,
                      progress: bool = False, **config_overrides) -> tuple[ModelConfig, Params]:
  """Reads an HF checkpoint directory -> (ModelConfig, params as a nested dict of numpy arrays).

  dtype: float32 or bfloat16 for every leaf except the router's correction bias (float32).
  compute_dtype: the returned config's `dtype` (activations and matmuls); None computes in the
  checkpoint's dtype, so a float32 checkpoint reproduces its reference logits as imported.
  MTP layers listed in config.json but absent from the weights (transformers never saves them)
  are dropped from the config with a warning. The whole model lands on this host: for a model
  larger than one host, c2.hf.sharded.import_sharded reads only each process's shards.
  """
  cfg, store, root = open_checkpoint(hf_dir, dtype=dtype, compute_dtype=compute_dtype,
                                     **config_overrides)
  plans = list(leaf_plans(cfg))
  bar = progress_bar(progress, sum(l.size * import_dtype(p, dtype).itemsize
                                   for p, l, *_ in plans), "import")
  params: dict = {}
  for path, leaf, prefixes, spec, stacked in plans:
    leaf_dtype = import_dtype(path, dtype)
    out = np.empty(leaf.shape, leaf_dtype)
    for k, prefix in enumerate(prefixes):
      dst = out[k] if stacked else out
      if leaf_dtype == np.float32:
        _read_slice(store, root + prefix, spec, dst)
      else:  # assemble in float32 one slice at a time, then round once
        tmp = np.empty(dst.shape, np.float32)
        _read_slice(store, root + prefix, spec, tmp)
        dst[...] = tmp
      bar.update(dst.nbytes)
    set_leaf(params, path, out)
  bar.close()
  return cfg, params


def _mapped_names(store: TensorStore, root: str, cfg: ModelConfig) -> set[str]:
  """Every stored tensor name the mapping reads (without reading any)."""
  names = set()
  for _, _, prefixes, (name, kind), _ in leaf_plans(cfg):
    for prefix in prefixes:
      if kind == "experts":
        experts = root + prefix + "mlp.experts."
        modules = [f"{experts}{e}.{name}" for e in range(cfg.num_routed_experts)]
        names.update((experts + "down_proj", experts + "gate_up_proj"))
      else:
        modules = [root + prefix + name]
      for module in modules:
        names.update({module} if kind is None else {
            module + s for s in (".weight", ".weight_scale_inv", ".weight_packed",
                                 ".weight_scale", ".weight_shape")})
  return names


def check_all_mapped(store: TensorStore, root: str, cfg: ModelConfig, hf_dir: str) -> None:
  """Every tensor of the checkpoint must feed a parameter: extra tensors mean the config does not
  describe these weights (a wrong config.json), and would otherwise be dropped silently."""
  skip = {root + "lm_head.weight"} if cfg.tie_word_embeddings else set()
  mapped = _mapped_names(store, root, cfg) | skip
  leftover = [n for n in store.names() if n not in mapped and not _skippable(n, root, cfg)]
  if leftover:
    raise CheckpointError(f"{hf_dir}: {len(leftover)} tensor(s) were not mapped to any parameter, "
                          f"e.g. {sorted(leftover)[:8]}; the config does not describe these weights")


def _skippable(name: str, root: str, cfg: ModelConfig) -> bool:
  if name.startswith(_NOT_WEIGHTS) or name.endswith("rotary_emb.inv_freq"):
    return True
  parts = name[len(root):].split(".")
  if parts[:2] == ["model", "layers"] and int(parts[2]) >= cfg.num_layers:
    # MTP copies of the shared embedding / head, and MTP layers beyond the imported depth.
    rest = ".".join(parts[3:])
    return rest in ("embed_tokens.weight", "shared_head.head.weight") or \
        int(parts[2]) >= cfg.num_layers + cfg.mtp_depth
  return False


def export_checkpoint(cfg: ModelConfig, params: Params, out_dir: str, *, dtype: str = "bfloat16",
                      max_shard_bytes: int = 5 << 30, progress: bool = False,
                      quantize_experts: bool = False) -> None:
  """Writes params as an HF DeepseekV3ForCausalLM checkpoint: config.json, sharded safetensors
  (model-0000k-of-0000n.safetensors) and model.safetensors.index.json.

  params: numpy arrays or jax.Arrays sharded over any mesh, also across processes (every process
  calls this; process 0 writes). One layer of a leaf, or one expert of it, is on the host at a
  time, and shards are written as they fill, so host memory stays at one output tensor.
  dtype: "bfloat16" or "float32" for every tensor except the router weight and correction bias,
  which stay float32 as transformers keeps them. quantize_experts: the routed experts as Kimi-K2.5
  stores them (compressed-tensors INT4, symmetric, group 32, `quantization_config` in
  config.json), so the result loads where the release does. MTP layers get their own copies of
  the embedding and output head, as DeepSeek-V3 checkpoints have them.
  The directory appears complete or not at all: everything is written to `out_dir.tmp-<pid>` and
  renamed into place at the end.
  """
  np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}.get(dtype)
  if np_dtype is None:
    raise ValueError(f"export dtype must be 'bfloat16' or 'float32', got {dtype!r}")
  expected = dict(_leaves(model_lib.abstract_params(cfg)))
  got = dict(_leaves(params))
  if set(got) != set(expected):
    raise ValueError(f"params do not match the config: missing {sorted(set(expected) - set(got))[:5]}"
                     f", unexpected {sorted(set(got) - set(expected))[:5]}")
  for path, leaf in got.items():
    if tuple(leaf.shape) != tuple(expected[path].shape):
      raise ValueError(f"param {'/'.join(path)} has shape {leaf.shape}, config expects "
                       f"{expected[path].shape}")
  out_dir = os.path.abspath(out_dir)
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    raise FileExistsError(f"{out_dir} exists and is not empty; export into a new directory")
  writing = jax.process_index() == 0
  tmp_dir = f"{out_dir}.tmp-{os.getpid()}"
  writer = ShardedWriter(tmp_dir, max_shard_bytes) if writing else None
  bar = progress_bar(progress and writing, sum(l.size * np.dtype(np_dtype).itemsize
                                               for l in got.values()), "export")
  for path, leaf in got.items():
    prefixes, key, stacked = _layer_plan(cfg, path)
    name, kind = _spec(path, key)
    leaf_dtype = np.float32 if key in _FLOAT32_ALWAYS else np_dtype
    per_expert = kind == "experts"
    units = [(k,) if stacked else () for k in range(len(prefixes))]
    if per_expert:
      units = [u + (e,) for u in units for e in range(cfg.num_routed_experts)]
    for unit in units:
      src = host_slice(leaf, unit)  # every process takes part in the gather
      if not writing:
        continue
      prefix = prefixes[unit[0] if stacked else 0]
      if per_expert:  # [D, F] / [F, D] -> HF [O, I]
        module = f"{prefix}mlp.experts.{unit[-1]}.{name}"
        for hf_name, tensor in _expert_tensors(module, src.T, quantize_experts, leaf_dtype):
          writer.add(hf_name, tensor)
      else:
        for hf_name, tensor in _hf_tensors(prefix, (name, kind), src.astype(leaf_dtype)):
          writer.add(hf_name, tensor)
      bar.update(src.size * np.dtype(np_dtype).itemsize)
      del src
  if cfg.mtp_depth:
    embed = host_slice(params["embed"]["embedding"], ())
    head = embed if cfg.tie_word_embeddings else host_slice(params["lm_head"], ()).T
    for j in range(cfg.mtp_depth):
      if writing:
        writer.add(f"model.layers.{cfg.num_layers + j}.embed_tokens.weight", embed.astype(np_dtype))
        writer.add(f"model.layers.{cfg.num_layers + j}.shared_head.head.weight",
                   head.astype(np_dtype))
  if writing:
    writer.close()
    bar.close()
    config = hf_config.to_hf_dict(cfg, torch_dtype=dtype)
    if quantize_experts:
      config["quantization_config"] = INT4_QUANTIZATION_CONFIG
    with open(os.path.join(tmp_dir, "config.json"), "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
    if os.path.isdir(out_dir):
      os.rmdir(out_dir)  # empty (checked above)
    os.replace(tmp_dir, out_dir)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(f"c2.hf.export {out_dir}")


def _expert_tensors(module: str, w: np.ndarray, quantize: bool, dtype
                    ) -> Iterator[tuple[str, np.ndarray]]:
  """One expert's [O, I] weight as stored: plain `.weight`, or INT4 packed + scale + shape."""
  if not quantize:
    yield f"{module}.weight", w.astype(dtype)
    return
  packed, scale = quantize_int4(np.asarray(w, np.float32), 32)
  yield f"{module}.weight_packed", packed
  yield f"{module}.weight_scale", scale
  yield f"{module}.weight_shape", np.array(w.shape, np.int32)

