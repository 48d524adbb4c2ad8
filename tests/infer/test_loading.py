"""load_for_serving on the three layouts (converted, training workdir, Hugging Face), bad paths."""
import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from c2 import config as config_lib
from c2.hf import checkpoint as hf_checkpoint
from c2.infer import loading
from c2.model.config import get_preset

SMALL = dict(dtype="bfloat16", num_layers=2, hidden_size=64, dense_ffn_size=128, moe_ffn_size=32,
             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, vocab_size=512, remat_policy="none")


@pytest.fixture(scope="module")
def tiny():
  cfg = get_preset("tiny", **SMALL)
  rng = np.random.default_rng(0)
  from c2 import model  # pylint: disable=import-outside-toplevel
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype),
                        model.abstract_params(cfg))
  return cfg, params


def assert_same_params(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_converted(tmp_path, tiny, tokenizer_512):
  cfg, params = tiny
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(str(tmp_path / "params"), params)
  (tmp_path / "model_config.json").write_text(loading.hf_config.to_json(cfg))
  shutil.copy(tokenizer_512, tmp_path / "tokenizer.json")
  got_cfg, got_params, tokenizer = loading.load_for_serving(str(tmp_path), dtype="float32")
  assert got_cfg == cfg.replace(dtype="float32") and tokenizer.vocab_size == 512
  assert_same_params(got_params, params)


def test_training_workdir(tmp_path, tiny, tokenizer_512):
  """The layout c2/train writes: tb/config.json (asdict of the experiment) + ckpt/<step>/params;
  the latest step is served, the optimizer state is never read."""
  cfg, params = tiny
  exp = config_lib.from_config_dict(config_lib.default_config("pretrain", "tiny"))
  (tmp_path / "tb").mkdir()
  (tmp_path / "tb" / "config.json").write_text(
      json.dumps(dataclasses.asdict(dataclasses.replace(exp, model=cfg)), default=str))
  manager = ocp.CheckpointManager(str(tmp_path / "ckpt"), item_names=("params", "meta"))
  for step, scale in ((3, 0.0), (6, 1.0)):
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(jax.tree.map(lambda x, s=scale: x * s, params)),
        meta=ocp.args.JsonSave({"step": step})))
  manager.wait_until_finished()
  manager.close()
  shutil.copy(tokenizer_512, tmp_path / "tokenizer.json")
  got_cfg, got_params, _ = loading.load_for_serving(str(tmp_path))
  assert got_cfg == cfg
  assert_same_params(got_params, params)


def test_hugging_face(tmp_path, tiny, tokenizer_512):
  cfg, params = tiny
  params32 = jax.tree.map(lambda x: x.astype(np.float32), params)
  hf_checkpoint.export_checkpoint(cfg.replace(param_dtype="float32"), params32, str(tmp_path),
                                  dtype="float32")
  shutil.copy(tokenizer_512, tmp_path / "tokenizer.json")
  got_cfg, got_params, _ = loading.load_for_serving(str(tmp_path), dtype="float32")
  assert got_cfg.dtype == "float32" and got_cfg.num_layers == cfg.num_layers
  np.testing.assert_array_equal(got_params["embed"]["embedding"], params32["embed"]["embedding"])


def test_bad_paths(tmp_path, tiny):
  with pytest.raises(loading.LoadError, match="no such directory"):
    loading.load_for_serving(str(tmp_path / "missing"))
  with pytest.raises(loading.LoadError, match="found none of"):
    loading.load_for_serving(str(tmp_path))
  (tmp_path / "model_config.json").write_text(loading.hf_config.to_json(tiny[0]))
  with pytest.raises(loading.LoadError, match="no params/"):
    loading.load_for_serving(str(tmp_path))
  os.makedirs(tmp_path / "w" / "tb")
  (tmp_path / "w" / "tb" / "config.json").write_text(json.dumps({"model": {"hidden_size": 1}}))
  with pytest.raises(loading.LoadError, match="not a ModelConfig"):
    loading.load_for_serving(str(tmp_path / "w"))
  with pytest.raises(loading.LoadError, match="dtype"):
    loading.load_for_serving(str(tmp_path), dtype="fp8")
