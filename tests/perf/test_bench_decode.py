"""c2.bench decode at toy sizes: the engine's greedy tokens equal transformers' generate, and every
section reports its ratio (speeds themselves are not asserted: tiny and noisy here)."""
import jax
import numpy as np
import pytest

from c2 import model
from c2.perf import bench_decode

PROMPT, NEW = 8, 6


@pytest.fixture(scope="module")
def small(small_cfg):
  cfg = small_cfg.replace(mtp_depth=1)
  params = model.init_params(cfg, jax.random.key(0))
  prompts = bench_decode.heldout_prompts(None, 4, PROMPT, cfg.vocab_size)
  return cfg, params, prompts


def test_greedy_tokens_match_transformers_at_batch_1(small, tmp_path):
  pytest.importorskip("transformers")
  cfg, params, prompts = small
  engine = bench_decode.make_engine(cfg, params, 1, 32)
  hf_model = bench_decode.load_hf(cfg, params, str(tmp_path))
  r = bench_decode.vs_transformers(engine, hf_model, prompts[:2], NEW)  # served in turn
  assert r["matching"] == r["total"] == 2
  assert r["ratio"] > 0 and r["c2_tps"] > 0 and r["hf_tps"] > 0


@pytest.mark.slow  # timing-only; the greedy identity above is the correctness check
def test_speculative_and_batching_report_ratios(small):
  cfg, params, prompts = small
  plain = bench_decode.make_engine(cfg, params, 2, 32)
  spec = bench_decode.make_engine(cfg, params, 2, 32, draft_depth=1)
  r = bench_decode.speculative(plain, spec, prompts[:2], NEW, temperature=1.0)
  assert 0 <= r["acceptance"] <= 1 and r["speedup"] > 0
  b = bench_decode.batching(plain, prompts, [3, 8, 5, 2])
  assert b["ratio"] > 0 and b["matching"] == b["total"] == 4  # same tokens under both policies
  assert bench_decode.RECOMPILES[0] == 0
