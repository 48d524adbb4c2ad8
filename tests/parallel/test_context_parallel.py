"""Context parallelism end to end: the zig-zag layout (c2/data/zigzag.py) and the full LM loss.

The loss (main head, MTP depth 1 with distillation and CE; MoE balance in the slow variant) and
its gradients on the small model with mesh context=4 x fsdp=2 and zig-zag batches equal the
single-device loss on the natural-order batch: that proves the permutation, the position masks,
the look-ahead targets, the MTP inputs and the MTP alignment together.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2 import model as model_lib
from c2.data import zigzag
from c2.losses import targets as targets_lib
from c2.losses.lm import LossWeights, lm_loss
from c2.parallel.mesh import make_mesh
from tests.packed_rows import packed_rows

B, T = 2, 64
DOCS = ([5, 20, 9, 19, 3], [40, 24])  # row 0 ends in 8 padding tokens


def _batch(vocab: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  seg, pos = packed_rows(DOCS, T)
  mask = (seg != 0).astype(np.float32)
  mask[0, 30:36] = 0  # a prompt span: not a target
  tokens = np.where(seg != 0, rng.integers(2, vocab, (B, T)), 0).astype(np.int32)
  return {"tokens": tokens, "segment_ids": seg, "positions": pos, "loss_mask": mask}


# ----------------------------------------------------------------------------- the layout


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_permutation_round_trip_and_chunk_ownership(shards):
  t = 8 * shards
  perm = zigzag.permutation(t, shards)
  x = np.arange(3 * t).reshape(3, t)
  np.testing.assert_array_equal(zigzag.from_zigzag(zigzag.to_zigzag(x, shards), shards), x)
  np.testing.assert_array_equal(np.sort(perm), np.arange(t))
  chunk, local = t // (2 * shards), t // shards
  for i in range(shards):  # shard i's contiguous slice holds [chunk i | chunk 2P-1-i]
    owned = perm[i * local:(i + 1) * local]
    np.testing.assert_array_equal(owned[:chunk], np.arange(i * chunk, (i + 1) * chunk))
    j = 2 * shards - 1 - i
    np.testing.assert_array_equal(owned[chunk:], np.arange(j * chunk, (j + 1) * chunk))


def test_permutation_rejects_lengths_that_do_not_split():
  with pytest.raises(ValueError, match="multiple of 2 x context"):
    zigzag.permutation(12, 4)


def test_zigzag_batch_carries_lookahead_that_matches_natural_targets():
  batch = _batch(97)
  zz = zigzag.zigzag_batch(batch, 4, max_offset=3)
  assert zigzag.is_zigzag(zz) and not zigzag.is_zigzag(batch)
  back = {key: zigzag.from_zigzag(value, 4) for key, value in zz.items()}
  for key in batch:
    np.testing.assert_array_equal(back[key], batch[key])
  for k in (1, 2, 3):
    want_t, want_w = targets_lib.next_token_targets(*(jnp.asarray(batch[n]) for n in (
        "tokens", "segment_ids", "loss_mask")), offset=k)
    got_t, got_w = targets_lib.batch_targets({n: jnp.asarray(v) for n, v in back.items()}, k)
    np.testing.assert_array_equal(got_t, want_t)
    np.testing.assert_array_equal(got_w, want_w)
    assert float(want_w.sum()) > 0
    np.testing.assert_array_equal(back[targets_lib.lookahead_keys(k)[0]],
                                  targets_lib.shift_left(jnp.asarray(batch["tokens"]), k))
  with pytest.raises(ValueError, match="already in zig-zag"):
    zigzag.zigzag_batch(zz, 4, 3)


def test_zigzag_only_for_latent_context_parallel_non_rl():
  assert zigzag.transform_for(context=4, context_parallel="latent_all_gather", phase="pretrain",
                              mtp_depth=1).keys() == (
      "next_tokens_1", "next_weights_1", "next_tokens_2", "next_weights_2")
  assert zigzag.transform_for(context=1, context_parallel="latent_all_gather",
                              phase="pretrain", mtp_depth=1) is None
  assert zigzag.transform_for(context=4, context_parallel="ulysses", phase="sft",
                              mtp_depth=1) is None
  assert zigzag.transform_for(context=4, context_parallel="latent_all_gather", phase="rl",
                              mtp_depth=1) is None


def test_config_validates_context_parallel(small_cfg):
  with pytest.raises(ValueError, match="ModelConfig.context_parallel"):
    small_cfg.replace(context_parallel="ring")


# ------------------------------------------------------------------------- the full loss


def _loss_and_grads(cfg, params, batch, mesh=None):
  weights = LossWeights(ce_chunk_size=64, mtp_weight=0.3, mtp_loss="distill+ce",
                        mtp_detach_trunk=False, balance_loss_weight=0.01)
  fn = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(cfg, p, b, weights)[0]))
  if mesh is None:
    return fn(params, batch)
  with jax.set_mesh(mesh):
    return fn(params, batch)


@pytest.mark.parametrize("strategy,layout,num_layers", [
    ("latent_all_gather", "zigzag", 1),  # one dense layer and a dense MTP block: compiles fast
    pytest.param("latent_all_gather", "zigzag", 2, marks=pytest.mark.slow),  # + MoE and balance
    pytest.param("ulysses", "natural", 1, marks=pytest.mark.slow)])
def test_lm_loss_context4_equals_context1(small_cfg, strategy, layout, num_layers):
  cfg = small_cfg.replace(mtp_depth=1, context_parallel=strategy, attention_impl="reference",
                          num_layers=num_layers)
  assert cfg.mtp_depth >= 1
  params = model_lib.init_params(cfg, jax.random.key(0))
  batch = _batch(cfg.vocab_size)
  want_loss, want_grads = _loss_and_grads(cfg, params, {k: jnp.asarray(v) for k, v in
                                                        batch.items()})
  parallel_batch = zigzag.zigzag_batch(batch, 4, cfg.mtp_depth + 1) if layout == "zigzag" \
      else batch
  got_loss, got_grads = _loss_and_grads(cfg, params, {k: jnp.asarray(v) for k, v in
                                                      parallel_batch.items()},
                                        make_mesh({"context": 4, "fsdp": 2}))
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  flat_want = jax.tree_util.tree_flatten_with_path(want_grads)[0]
  worst = 0.0
  for (path, want), got in zip(flat_want, jax.tree.leaves(got_grads)):
    scale = float(jnp.max(jnp.abs(want)))
    err = float(jnp.max(jnp.abs(got - want)))
    worst = max(worst, err / max(scale, 1e-30))
    where = jax.tree_util.keystr(path)
    assert err <= 1e-5 * scale + 1e-7, f"{where}: {err:.3g} (max {scale:.3g})"
  print(f"{strategy}/{layout}/{num_layers} layers: loss {float(want_loss):.6f} vs "
        f"{float(got_loss):.6f}, worst relative grad error {worst:.3g}")


@pytest.mark.slow
def test_trainer_feeds_zigzag_batches_to_the_latent_path(small_experiment, tmp_path):
  """With context=4 and the latent path, the trainer's iterator yields zig-zag batches with
  look-ahead arrays, the program takes them, and a train step runs to a finite loss."""
  from c2.data import loader
  from c2.train import loop as train
  from c2.train import program as program_lib
  build, seed_dir = small_experiment
  exp = build(**{"mesh.context": 4, "mesh.fsdp": 2, "mesh.data": 1, "mesh.expert": 1,
                 "model.context_parallel": "latent_all_gather"})
  workdir = seed_dir(tmp_path / "run")
  mesh = train.make_mesh(exp)
  tokenizer = train.make_tokenizer(exp, workdir)
  batch = next(train.make_iterator(exp, tokenizer, "train"))
  assert zigzag.is_zigzag(batch)
  natural = zigzag.from_zigzag(batch["positions"], 4)
  assert np.all((np.diff(natural, axis=1) == 1) | (natural[:, 1:] == 0))  # rows un-permute
  program = program_lib.build(exp, mesh)
  assert set(program.abstract_batch) == set(batch)
  state = program.init_state(0)
  with program.context():
    _, metrics = program.train_step(state, loader.to_global(batch, mesh))
  assert np.isfinite(float(metrics["loss"])) and float(metrics["tokens"]) > 0
