"""The long-context extension experiment: variants convert, a run starts from a pretraining
checkpoint (params and the optimizer state exactly), clear errors for checkpoints that cannot
give an optimizer state, and long-document packing drops short documents."""
import json
import math

import jax
import numpy as np
import optax
import pytest

from c2 import config as config_lib
from c2.cli import load_experiment
from c2.data import pipeline
from c2.data.tokenizer import HuggingFaceTokenizer
from c2.parallel import mesh as meshlib
from c2.train import checkpoint as ckpt_lib
from c2.train import loop as train
from c2.train import program as program_lib
from tests.conftest import SMALL_MODEL


@pytest.mark.parametrize("variant", ["tiny", "proxy", "full"])
def test_variants_convert(variant):
  exp = config_lib.from_config_dict(load_experiment(f"experiments/extend_256k.py:{variant}"))
  assert exp.phase == "long_context" and exp.train.init_from and exp.train.init_from_optimizer
  assert exp.data.min_doc_tokens > 0 and "ruler" in exp.train.eval_suites
  if variant == "tiny":  # 8x the 256 tokens of experiments/pretrain.py:tiny, YaRN over those
    assert exp.data.seq_len == 2048 == exp.model.max_position_embeddings
    assert (exp.model.rope_scaling.factor, exp.model.rope_scaling.original_max_position_embeddings
            ) == (8.0, 256)
    return
  # proxy and full keep Kimi K2.5's YaRN (64 over 4096) and train at its whole range.
  assert exp.data.seq_len == 262144 == exp.model.max_position_embeddings
  assert exp.model.rope_scaling.factor == 64.0 and exp.optim.min_lr_ratio == 1.0
  chips = math.prod(int(d) for d in exp.aot.topology.split(":")[1].split("x"))
  sizes = exp.validate_for_devices(chips * exp.mesh.num_slices)
  assert sizes["context"] >= 8


def _extension(small_experiment, base_ckpt, **overrides):
  """experiments/extend_256k.py:tiny on the test model: 64-token phase 1 -> 128 tokens."""
  c = load_experiment("experiments/extend_256k.py:tiny")
  c.model.update(SMALL_MODEL)
  c.model.rope_scaling.update(factor=2.0, original_max_position_embeddings=64)
  c.model.max_position_embeddings = 128
  c.data.update(tokenizer="default", seq_len=128, global_batch_size=8, tokenizer_vocab_size=512,
                min_doc_tokens=128)
  c.optim.update(warmup_steps=1)
  c.train.update(init_from=base_ckpt, steps=2, max_minutes=None, log_every=1, eval_every=2,
                 eval_batches=1, ce_chunk_size=256, eval_suites="")
  c.checkpoint.update(every_steps=2, async_save=False)
  for dotted, value in overrides.items():
    section, key = dotted.split(".")
    c[section][key] = value
  return config_lib.from_config_dict(c)


def _schedule_counts(opt_state):
  return [s.count for s in jax.tree.leaves(
      opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState))
          if isinstance(s, optax.ScaleByScheduleState)]


@pytest.mark.slow  # two short runs, three program builds: 118 s on 2 shared, busy cores
def test_extension_starts_from_the_checkpoint_with_its_optimizer_state(small_experiment,
                                                                      tmp_path):
  build, seed_dir = small_experiment
  train.run(build(**{"train.steps": 3}), seed_dir(tmp_path / "base"))
  base = str(tmp_path / "base" / "ckpt")
  exp = _extension(small_experiment, base)
  program = program_lib.build(exp, meshlib.make_mesh({}, devices=jax.devices()[:1]))
  saved, _ = ckpt_lib.Checkpointer(base).restore(program.abstract_state)
  load = train._load_init_from  # pylint: disable=protected-access
  loaded = load(exp, program, program.init_state(1))
  # Moments and Adam's count exactly as saved; only the lr schedule restarts at 0.
  counts = _schedule_counts(loaded.opt_state)
  assert counts and all(int(c) == 0 for c in counts)
  assert all(int(c) == 3 for c in _schedule_counts(saved.opt_state))
  restarted = train.restart_schedules(saved.opt_state)
  for got, want in zip(jax.tree.leaves(loaded.opt_state), jax.tree.leaves(restarted), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(saved.params), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Model only: the same params, fresh moments.
  fresh = load(_extension(small_experiment, base, **{"train.init_from_optimizer": False}),
               program, program.init_state(1))
  mu = [l for p, l in jax.tree_util.tree_flatten_with_path(fresh.opt_state)[0]
        if "mu" in jax.tree_util.keystr(p)]
  assert mu and all(not np.any(np.asarray(m)) for m in mu)

  # Another optimizer (muon's state has another structure): a clear error, not Orbax's.
  muon = _extension(small_experiment, base, **{"optim.name": "muon"})
  muon_program = program_lib.build(muon, meshlib.make_mesh({}, devices=jax.devices()[:1]))
  with pytest.raises(ValueError, match="optimizer state does not match"):
    load(muon, muon_program, muon_program.init_state(0))

  # A couple of steps of the experiment itself, through the trainer.
  workdir = seed_dir(tmp_path / "ext")
  final = train.run(exp, workdir)
  rows = [json.loads(l) for l in (tmp_path / "ext" / "tb" / "metrics.jsonl").read_text().split("\n")
          if l]
  losses = [r["train/loss"] for r in rows if "train/loss" in r]
  assert len(losses) == 2 and all(np.isfinite(losses)) and np.isfinite(final["eval/ce"])
  assert (tmp_path / "ext" / "ckpt" / "2").is_dir()


def test_init_from_optimizer_errors_are_clear(small_experiment, tmp_path):
  build, _ = small_experiment
  with pytest.raises(config_lib.ConfigError, match="init_from_optimizer=True needs"):
    build(**{"train.init_from_optimizer": True})
  with pytest.raises(config_lib.ConfigError, match="min_doc_tokens=-1"):
    build(**{"data.min_doc_tokens": -1})
  with pytest.raises(config_lib.ConfigError, match=r"repeat_fraction=1.5 must be in \[0, 1\]"):
    build(**{"data.repeat_fraction": 1.5})
  converted = tmp_path / "converted"  # the layout of `python -m c2.hf.convert import`
  converted.mkdir()
  (converted / "model_config.json").write_text("{}")
  with pytest.raises(ValueError, match="holds model weights only"):
    ckpt_lib.restore_opt_state(str(converted), abstract_opt_state=None)


def test_min_doc_tokens_drops_short_documents(tmp_path, tokenizer_512):
  tokenizer = HuggingFaceTokenizer.from_file(tokenizer_512)
  docs = [f"short_{i} = {i}\n" for i in range(4)]
  docs += [f"long_{i} = [" + ", ".join(str(j) for j in range(60)) + "]\n" for i in range(3)]
  lengths = [len(tokenizer.encode(d)) for d in docs]
  assert max(lengths[:4]) < 32 < min(lengths[4:])
  path = tmp_path / "heldout.jsonl"
  path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  seen = ""
  for batch in pipeline.make_lm_iterator(
      source_spec=f"jsonl:{path}", tokenizer=tokenizer, seq_len=64, batch_size=1, seed=0,
      process_index=0, process_count=1, split="heldout", num_epochs=1, min_example_tokens=32):
    seen += tokenizer.decode([int(t) for t in batch["tokens"][0] if t != tokenizer.pad_id])
  assert "short_" not in seen and all(f"long_{i}" in seen for i in range(3))
