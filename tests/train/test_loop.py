"""The pretraining step and run loop: mesh equivalence, overfitting, exact resume, TensorBoard."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2.parallel import mesh as meshlib
from c2 import model as model_lib
from c2.train import loop as train
from c2.train import program as program_lib
from c2.losses.lm import LossWeights, lm_loss


def _batch(cfg, b=8, t=32, seed=0):
  rng = np.random.default_rng(seed)
  seg = np.repeat([[1] * (t // 2) + [2] * (t // 2 - 2) + [0, 0]], b, 0)
  pos = np.repeat([list(range(t // 2)) + list(range(t // 2 - 2)) + [0, 0]], b, 0)
  return {"tokens": jnp.asarray(rng.integers(3, cfg.vocab_size, (b, t)), jnp.int32),
          "segment_ids": jnp.asarray(seg, jnp.int32), "positions": jnp.asarray(pos, jnp.int32),
          "loss_mask": jnp.asarray(seg > 0, jnp.float32)}


def test_step_on_mesh_equals_single_device(small_experiment, program_on):
  build, _ = small_experiment
  exp = build(**{"model.a2a_impl": "padded", "model.dtype": "float32"})
  batch = _batch(exp.model)
  results = {}
  for name, layout in [("single", {}), ("mesh", {"fsdp": 2, "expert": 2, "tensor": 2})]:
    mesh = meshlib.make_mesh(layout, devices=jax.devices()[:1] if not layout else None)
    state, step = program_on(exp, mesh)
    losses = []
    with jax.set_mesh(mesh):
      for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    results[name] = (losses, jax.device_get(state.params))
  np.testing.assert_allclose(results["mesh"][0], results["single"][0], rtol=1e-5)
  # Three optimizer steps later the parameters still agree (Adam moves each by up to ~3 * lr).
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), results["mesh"][1],
                       results["single"][1])
  assert max(jax.tree.leaves(diffs)) < 1e-4


def test_overfitting_one_batch_drives_loss_near_zero(small_experiment, program_on):
  build, _ = small_experiment
  exp = build(**{"train.steps": 40, "optim.warmup_steps": 3})
  state, step = program_on(exp)
  batch = _batch(exp.model, seed=1)
  first = None
  for _ in range(40):
    state, metrics = step(state, batch)
    first = first if first is not None else float(metrics["ce"])
  assert first > 5.0  # ~ln(512) at init
  assert float(metrics["ce"]) < 0.05
  assert float(metrics["mtp/1/top1_agreement"]) > 0.9  # MTP learned the main head too


def test_every_auxiliary_loss_is_nonzero_with_gradient(small_experiment):
  """Each auxiliary term, alone, gives a non-zero value and gradient through the real loss."""
  build, _ = small_experiment
  exp = build()
  params = model_lib.init_params(exp.model, jax.random.key(0))
  batch = _batch(exp.model)
  only = {
      "z_loss": LossWeights(ce_chunk_size=64, z_loss_weight=1.0, mtp_weight=0.0),
      "mtp_distill": LossWeights(ce_chunk_size=64, mtp_weight=1.0, mtp_loss="distill"),
      "mtp_ce": LossWeights(ce_chunk_size=64, mtp_weight=1.0, mtp_loss="ce"),
      "balance": LossWeights(ce_chunk_size=64, mtp_weight=0.0, balance_loss_weight=1.0),
  }
  base = LossWeights(ce_chunk_size=64, mtp_weight=0.0)
  # Jitted (one compile per weighting): op-by-op autodiff of the whole model took minutes.
  loss_and_grad = jax.jit(jax.value_and_grad(lambda p, w: lm_loss(exp.model, p, batch, w)[0]),
                          static_argnums=1)
  base_value, base_grad = loss_and_grad(params, base)
  for name, weights in only.items():
    value, grads = loss_and_grad(params, weights)
    assert float(value - base_value) > 1e-4, name
    extra = jax.tree.map(lambda g, b: float(jnp.abs(g - b).sum()), grads, base_grad)
    assert sum(jax.tree.leaves(extra)) > 1e-6, name
    if name == "balance":  # the balance loss must reach the router, not just exist
      assert extra["moe_layers"]["block"]["moe"]["router"] > 0
    if name.startswith("mtp"):
      assert sum(jax.tree.leaves(extra["mtp_0"])) > 0


def test_resume_is_exact_and_tensorboard_has_the_scalars(small_experiment, tmp_path):
  """Stop at step 3 and resume: step 4's loss equals the uninterrupted run's."""
  build, seed_dir = small_experiment
  exp = build(**{"train.steps": 4})
  straight = train.run(exp, seed_dir(tmp_path / "straight"))
  resumed_dir = seed_dir(tmp_path / "resumed")
  train.run(exp, resumed_dir, max_steps=3)
  resumed = train.run(exp, resumed_dir)
  assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-6, abs=1e-6)
  assert resumed["eval/ce"] == pytest.approx(straight["eval/ce"], rel=1e-6, abs=1e-6)

  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(tmp_path / "straight" / "tb"))
  events.Reload()
  tags = set(events.Tags()["scalars"])
  expected = {"train/loss", "eval/loss", "eval/ce", "train/mtp/1/kl", "train/mtp/1/top1_agreement",
              "train/learning_rate", "train/grad_norm", "train/moe/load_max_over_mean",
              "train/moe/load_entropy", "train/moe/bias_abs_mean", "perf/tokens_per_sec",
              "perf/step_time_sec", "perf/mfu", "eval/unigram_entropy"}
  assert expected <= tags, expected - tags
  assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
  assert "config" in events.Tags()["tensors"] or "config/text_summary" in events.Tags()["tensors"]
  config = json.loads((tmp_path / "straight" / "tb" / "config.json").read_text())
  assert config["model"]["hidden_size"] == exp.model.hidden_size


def test_init_from_attaches_fresh_mtp_to_a_checkpoint_without_it(small_experiment, tmp_path,
                                                                  monkeypatch):
  """Composer 2 attaches MTP to a mid-run checkpoint: trunk restored, MTP freshly initialised."""
  build, seed_dir = small_experiment
  without_mtp = build(**{"model.mtp_depth": 0, "train.steps": 2, "train.eval_every": 2})
  train.run(without_mtp, seed_dir(tmp_path / "base"))
  with_mtp = build(**{"train.init_from": str(tmp_path / "base" / "ckpt")})
  program = program_lib.build(with_mtp, meshlib.make_mesh({}, devices=jax.devices()[:1]))
  fresh = program.init_state(0)
  loaded = train._load_init_from(with_mtp, program, fresh)  # pylint: disable=protected-access
  from c2.train import checkpoint as ckpt_lib
  saved, missing = ckpt_lib.restore_params_subset(
      str(tmp_path / "base" / "ckpt"), jax.tree.map(np.asarray, fresh.params))
  assert missing == ["mtp_0"]
  np.testing.assert_array_equal(loaded.params["lm_head"], saved["lm_head"])
  assert not np.array_equal(loaded.params["lm_head"], fresh.params["lm_head"])
  np.testing.assert_array_equal(loaded.params["mtp_0"]["eh_proj"], fresh.params["mtp_0"]["eh_proj"])
  monkeypatch.chdir(tmp_path)  # the documented pipeline passes relative paths (runs/tiny/ckpt)
  relative, _ = ckpt_lib.restore_params_subset("base/ckpt", jax.tree.map(np.asarray, fresh.params))
  np.testing.assert_array_equal(relative["lm_head"], saved["lm_head"])


@pytest.mark.slow  # ~74 s on 2 cores (two runs and a restore); the default suite keeps under 15 min
def test_eval_at_start_scores_the_start_checkpoint_at_step_0(small_experiment, tmp_path):
  """train.eval_at_start: a run from init_from logs the checkpoint's held-out loss at step 0,
  the value its own run ended with (same params, same held-out batches)."""
  build, seed_dir = small_experiment
  base = train.run(build(**{"train.steps": 2, "train.eval_every": 2}), seed_dir(tmp_path / "base"))
  train.run(build(**{"train.steps": 2, "train.eval_every": 2, "train.eval_at_start": True,
                     "train.init_from": str(tmp_path / "base" / "ckpt")}),
            seed_dir(tmp_path / "next"))
  rows = [json.loads(line) for line in
          (tmp_path / "next" / "tb" / "metrics.jsonl").read_text().splitlines() if line]
  at_start = [r["eval/ce"] for r in rows if r.get("step") == 0 and "eval/ce" in r]
  assert at_start == [pytest.approx(base["eval/ce"], rel=1e-5)]
  assert [r["step"] for r in rows if "eval/ce" in r] == [0, 2]
