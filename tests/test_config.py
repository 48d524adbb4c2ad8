"""Experiment files load for every variant, and bad configs stop with a message naming the key."""
import pytest

from c2 import config as config_lib
from c2.cli import load_experiment


@pytest.mark.parametrize("path", ["experiments/pretrain.py:tiny", "experiments/pretrain.py:proxy",
                                  "experiments/pretrain.py:full",
                                  "experiments/pretrain.py:copy_drills",
                                  "experiments/pretrain.py:copy_drills_128",
                                  "experiments/pretrain.py:copy_drills_512",
                                  "experiments/pretrain.py:needles"])
def test_experiment_variants_convert(path):
  exp = config_lib.from_config_dict(load_experiment(path))
  assert exp.phase == "pretrain"
  if path.endswith("needles"):  # documents with needles, from the copy-drilled checkpoint
    assert exp.data.repeat_fraction > 0 and exp.data.copy_drill_span > 0
    assert exp.train.init_from == "runs/copy-512/ckpt"
  if path.endswith("full"):
    assert exp.model.num_routed_experts == 384 and exp.data.seq_len == 32768
    assert exp.aot.topology.startswith(("v5p", "tpu7x"))


def _tiny(**updates):
  c = load_experiment("experiments/pretrain.py:tiny")
  for dotted, value in updates.items():
    section, key = dotted.split(".")
    c[section][key] = value
  return c


def _error(c) -> str:
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.from_config_dict(c)
  return str(info.value)


def test_unknown_key_suggests_the_right_one():
  raw = _tiny().to_dict()
  raw["train"]["stpes"] = 10
  message = _error(raw)
  assert "config.train.stpes" in message and "did you mean train.steps" in message


def test_wrong_type_names_the_key():
  raw = _tiny().to_dict()
  raw["optim"]["peak_lr"] = "fast"
  assert "config.optim.peak_lr" in _error(raw) and "float" in _error(raw)


def test_seq_len_above_rope_range():
  message = _error(_tiny(**{"data.seq_len": 100_000}))
  assert "config.data.seq_len=100000" in message and "max_position_embeddings" in message


def test_bad_model_field_and_value():
  raw = _tiny().to_dict()
  raw["model"]["experts_per_token"] = 64
  assert "experts_per_token" in _error(raw)
  raw = _tiny().to_dict()
  raw["model"]["hiden_size"] = 3
  assert "did you mean model.hidden_size" in _error(raw)


def test_batch_not_divisible_and_mesh_too_large():
  exp = config_lib.from_config_dict(_tiny(**{"data.global_batch_size": 6}))
  with pytest.raises(config_lib.ConfigError, match="global_batch_size=6 is not divisible"):
    exp.validate_for_devices(8)
  exp = config_lib.from_config_dict(_tiny(**{"mesh.fsdp": 16}))
  with pytest.raises(config_lib.ConfigError, match="config.mesh"):
    exp.validate_for_devices(8)
  assert config_lib.from_config_dict(_tiny()).validate_for_devices(8)["fsdp"] == 8


def test_sft_needs_a_chat_source():
  c = _tiny()
  c.phase = "sft"
  assert "sft phase needs a chat JSONL" in _error(c)


def test_copy_drills_are_a_pretraining_source():
  c = load_experiment("experiments/pretrain.py:copy_drills")
  assert config_lib.from_config_dict(c).data.source.startswith("copy_drills:")
  c.phase = "sft"
  message = _error(c)
  assert "config.data.source='copy_drills:" in message and "pretrain.py:copy_drills" in message


@pytest.mark.parametrize("variant", ["tiny", "full"])
def test_rl_experiment_variants_convert_with_their_environment(variant):
  exp = config_lib.from_config_dict(load_experiment(f"experiments/rl.py:{variant}"))
  assert exp.phase == "rl" and exp.env is not None
  from c2.envs.config import to_env_config
  env = to_env_config(exp.env)
  assert "finish" in env.tools.enabled
  if variant == "full":
    assert exp.mesh.expert == 8 and exp.mesh.context == 8 and exp.rl.draft_depth >= 1


def test_engine_dtype_reaches_the_engines_not_the_learner():
  from c2.rl import learner  # pylint: disable=import-outside-toplevel
  c = load_experiment("experiments/rl.py:tiny")
  c.rl.engine_dtype = ""
  exp = config_lib.from_config_dict(c)
  assert learner.worker_spec(exp, "/tmp/unused", "tok.json").model.dtype == exp.model.dtype
  c.rl.engine_dtype = "float32"
  exp = config_lib.from_config_dict(c)
  assert exp.model.dtype == "bfloat16"  # the learner's compute dtype is untouched
  assert learner.worker_spec(exp, "/tmp/unused", "tok.json").model.dtype == "float32"


@pytest.mark.parametrize("key, value, message", [
    ("rl.backend", "mpi", "choose threads or ray"),
    ("rl.kl_placement", "both", "choose reward, loss or none"),
    ("rl.min_token_entropy", -0.1, "it is in nats, >= 0"),
    ("rl.drop_uniform_groups", "true", "choose off, reward or outcome"),
    ("rl.group_size", 1, "group_size must be >= 2"),
    ("rl.decode_steps", 0, "must be >= 1"),
    ("rl.engine_dtype", "float16", "choose bfloat16, float32"),
    ("rl.max_context", 4096, "exceeds data.seq_len"),
    ("rl.task_levels", "1,x", "comma-separated integers"),
    ("rl.tasks", "s3://tasks", "jsonl:"),
    ("rl.curriculum_weights", "informative=1,reward=2", "unknown signals ['reward']"),
    ("rl.curriculum_weights", "turns:1", "is not SIGNAL=WEIGHT"),
    ("rl.curriculum_floor", 0.0, "curriculum_floor=0.0 > 0"),
])
def test_bad_rl_settings_name_the_key(key, value, message):
  c = load_experiment("experiments/rl.py:tiny")
  section, name = key.split(".")
  c[section][name] = value
  assert message in _error(c) and name in _error(c)


def test_bad_rl_environment_key_is_named():
  c = load_experiment("experiments/rl.py:tiny")
  c.env.tools.enabled = "read_file,edit_file"
  assert "finish" in _error(c)


def test_negative_focal_gamma_names_the_field():
  raw = _tiny().to_dict()
  raw["train"]["focal_gamma"] = -1.0
  assert "config.train.focal_gamma=-1.0 must be >= 0" in _error(raw)
