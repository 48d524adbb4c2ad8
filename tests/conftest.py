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

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def small_cfg():
  """The tiny preset cut to one dense + one MoE layer in float32: compiles in seconds on CPU."""
  from c2.model_config import get_preset
  return get_preset("tiny", dtype="float32", num_layers=2, hidden_size=64, dense_ffn_size=128,
                    moe_ffn_size=32, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, remat_policy="none")
