"""Test session setup: CPU backend with 8 fake devices, so sharding code runs for real.

The environment must be set before jax is imported anywhere, which is why it lives here.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# AOT tests load libtpu (compile-only); parallel test workers would otherwise fight over its
# process lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import tempfile  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# One persistent compilation cache per test session (shared by the xdist workers of one run):
# tests that build the same program again (a run, then its resume; one small experiment in
# several tests) load it instead of compiling it again. Fresh per session, so never stale: the
# controller makes it when it loads this file, before it starts the workers, which inherit the
# variable, and removes it when the session finishes.
if "C2_TEST_JAX_CACHE" not in os.environ:
  os.environ["C2_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="c2-test-jax-cache-")
_CACHE_DIR = os.environ["C2_TEST_JAX_CACHE"]
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import pytest  # noqa: E402


def pytest_sessionfinish(session):
  """Removes the session's compilation cache; xdist workers leave it to the controller, which
  finishes last."""
  if not hasattr(session.config, "workerinput"):
    import shutil
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def small_cfg():
  """The tiny preset cut to one dense + one MoE layer in float32: compiles in seconds on CPU."""
  from c2.model.config import get_preset
  return get_preset("tiny", dtype="float32", num_layers=2, hidden_size=64, dense_ffn_size=128,
                    moe_ffn_size=32, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, remat_policy="none")


SMALL_MODEL = dict(num_layers=2, hidden_size=64, dense_ffn_size=128, moe_ffn_size=32,
                   q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16, vocab_size=512, remat_policy="none")


@pytest.fixture(scope="session")
def tokenizer_512(tmp_path_factory):
  """A 512-id default (stdlib BPE) tokenizer file, trained once per session on 600 KB."""
  from c2.data import default_tokenizer
  return default_tokenizer.ensure_default_tokenizer(
      tmp_path_factory.mktemp("tok512"), vocab_size=512, max_train_bytes=600_000)


@pytest.fixture
def small_experiment(tokenizer_512):
  """experiments/pretrain.py:tiny shrunk to seconds per step; returns (ExperimentConfig, seed_dir).

  Call `seed_dir(workdir)` to place the cached tokenizer in a workdir before `train.run`.
  """
  import shutil

  from c2 import config as config_lib
  from c2.cli import load_experiment

  def build(**overrides):
    c = load_experiment("experiments/pretrain.py", "tiny")
    c.model.update(SMALL_MODEL)
    c.data.update(seq_len=64, global_batch_size=8, tokenizer_vocab_size=512)
    c.optim.update(warmup_steps=2, peak_lr=3e-3)
    c.train.update(steps=6, max_minutes=None, log_every=1, eval_every=3, eval_batches=1,
                   ce_chunk_size=256)
    c.checkpoint.update(every_steps=3, async_save=False)
    for dotted, value in overrides.items():
      section, key = dotted.split(".")
      c[section][key] = value
    return config_lib.from_config_dict(c)

  def seed_dir(workdir):
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_512, workdir / "tokenizer.json")
    return str(workdir)

  return build, seed_dir
