"""The SFT experiment: variants convert, the step learns a real SFT batch, a short run trains."""
import dataclasses
import json
import math

import numpy as np
import pytest

from c2 import config as config_lib
from c2.train import loop as train
from c2.data import pipeline
from c2.data.tokenizer import HuggingFaceTokenizer
from c2.cli import load_experiment, load_module


@pytest.mark.parametrize("variant", ["tiny", "proxy", "full"])
def test_sft_variants_convert(variant):
  exp = config_lib.from_config_dict(load_experiment(f"experiments/sft.py:{variant}"))
  assert exp.phase == "sft" and exp.data.sft_train_on == "current_turn"
  if variant == "tiny":
    assert exp.data.source == "stdlib_chat" and exp.train.init_from is None
  else:  # the default AOT topology holds a mesh the batch divides
    chips = math.prod(int(d) for d in exp.aot.topology.split(":")[1].split("x"))
    exp.validate_for_devices(chips * exp.mesh.num_slices)
  sweep = load_module("experiments/sft.py").get_sweep()
  assert sweep and all(key.startswith("optim.") for point in sweep for key in point)


def _small_sft(small_cfg, *, seq_len=128, global_batch_size=8, **train_overrides):
  """experiments/sft.py:tiny with the test model (float32) and a 512-id tokenizer."""
  c = load_experiment("experiments/sft.py:tiny")
  c.data.update(seq_len=seq_len, global_batch_size=global_batch_size, tokenizer_vocab_size=512)
  c.optim.update(warmup_steps=2, peak_lr=3e-3)
  c.train.update(max_minutes=None, log_every=1, eval_batches=1, ce_chunk_size=256,
                 **train_overrides)
  c.checkpoint.update(async_save=False)
  exp = config_lib.from_config_dict(c)
  return dataclasses.replace(exp, model=small_cfg)


def test_sft_step_fits_a_repeated_chat_batch(small_cfg, tokenizer_512, program_on):
  exp = _small_sft(small_cfg, global_batch_size=4, steps=40)
  batch = next(pipeline.make_sft_iterator(
      source_spec="stdlib_chat", tokenizer=HuggingFaceTokenizer.from_file(tokenizer_512),
      seq_len=exp.data.seq_len, batch_size=exp.data.global_batch_size, seed=0, process_index=0,
      process_count=1))
  assert 0.2 < batch["loss_mask"].mean() < 0.9  # prompts are masked, replies are not
  state, step = program_on(exp)
  ces = []
  for _ in range(40):
    state, metrics = step(state, batch)
    ces.append(float(metrics["ce"]))
  assert ces[0] > 5.5  # ~ln(512) at init
  assert ces[-1] < ces[0] / 5, ces  # ~0.7 after 40 steps


def test_sft_experiment_trains_a_few_steps(small_cfg, tokenizer_512, tmp_path):
  """train.run on the stdlib chats: finite falling loss, eval on held-out chats, a checkpoint."""
  # 256-token rows: at 128, a batch can hold only prompt pieces of the cut chats (no targets).
  exp = _small_sft(small_cfg, seq_len=256, steps=8, eval_every=8)
  workdir = tmp_path / "sft"
  workdir.mkdir()
  (workdir / "tokenizer.json").write_bytes(tokenizer_512.read_bytes())
  final = train.run(exp, str(workdir))
  rows = [json.loads(line) for line in (workdir / "tb" / "metrics.jsonl").read_text().splitlines()]
  losses = {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}
  assert sorted(losses) == list(range(1, 9))
  assert all(np.isfinite(v) for v in losses.values())
  assert losses[8] < losses[1] - 0.5, losses
  assert np.isfinite(final["eval/ce"]) and final["eval/ce"] < losses[1]
  assert (workdir / "ckpt" / "8").is_dir()
