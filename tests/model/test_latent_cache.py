"""The decoding form (latent cache, weight-absorbed MLA) computes the training forward's function.

Float32, tolerance 1e-5 on logits of size ~5: the two forms differ only in summation order
(~1e-6 measured); a wrong mask, position or cache slot is O(1).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2 import model
from c2.infer import cache as cache_lib

TOL = 1e-5


def test_window_sizes_nest_and_end_with_the_capacity():
  from c2.model.latent_cache import window_sizes  # pylint: disable=import-outside-toplevel
  assert window_sizes(1536, 4) == (192, 384, 768, 1536)
  assert window_sizes(48, 4) == (8, 16, 24, 48)
  assert window_sizes(179, 4) == (24, 48, 96, 179)
  assert window_sizes(64, 1) == window_sizes(64, 0) == (64,)


def _setup(cfg, slots=3, capacity=48):
  params = model.init_params(cfg, jax.random.key(0))
  cache = cache_lib.allocate(cfg, slots, capacity, draft_depth=1, dtype=jnp.float32)
  return params, cache


@functools.partial(jax.jit, static_argnums=0)
def _chunk(cfg, params, stacks, tokens, rows, starts):
  """Jitted (eager dispatch of the scanned model costs minutes); one compile per chunk shape."""
  t = tokens.shape[1]
  out = model.forward(cfg, params, tokens, jnp.ones_like(tokens), starts[:, None] + jnp.arange(t),
                      with_mtp=False, cache=(stacks, rows, starts))
  return out, jnp.einsum("BTD,DV->BTV", out["hidden"], model.head_kernel(cfg, params))


@pytest.mark.parametrize("windows", [0, 4])  # 4: attention over nested prefixes (8 .. 48)
def test_chunked_prefill_and_decode_match_full_forward(small_cfg, windows):
  cfg = small_cfg.replace(cache_windows=windows)
  params, cache = _setup(cfg)
  tokens = jax.random.randint(jax.random.key(1), (2, 30), 0, cfg.vocab_size)
  expected = model.logits(cfg, params, tokens)
  stacks, rows = cache.trunk_stacks, jnp.array([2, 0])
  got, start = [], 0
  for end in (11, 12, 20, 27, 28, 29, 30):  # chunks of 11, then single tokens and uneven chunks
    out, logits = _chunk(cfg, params, stacks, tokens[:, start:end], rows, jnp.full(2, start))
    stacks, start = out["kv_cache"], end
    got.append(logits)
  np.testing.assert_allclose(jnp.concatenate(got, 1), expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("windows", [0, 4])
def test_slot_reuse_sees_only_its_own_sequence(small_cfg, windows):
  cfg = small_cfg.replace(cache_windows=windows)
  params, cache = _setup(cfg)
  stacks, row = cache.trunk_stacks, jnp.array([1])
  old = jax.random.randint(jax.random.key(2), (1, 40), 0, cfg.vocab_size)
  stacks = _chunk(cfg, params, stacks, old, row, jnp.zeros(1, jnp.int32))[0]["kv_cache"]
  new = jax.random.randint(jax.random.key(3), (1, 9), 0, cfg.vocab_size)
  out, first = _chunk(cfg, params, stacks, new[:, :5], row, jnp.zeros(1, jnp.int32))
  _, rest = _chunk(cfg, params, out["kv_cache"], new[:, 5:], row, jnp.full(1, 5))
  np.testing.assert_allclose(jnp.concatenate([first, rest], 1), model.logits(cfg, params, new),
                             atol=TOL, rtol=0)


def test_padding_in_a_chunk_writes_nothing(small_cfg):
  cfg = small_cfg
  params, cache = _setup(cfg)
  tokens = jax.random.randint(jax.random.key(4), (1, 6), 0, cfg.vocab_size)
  segments = jnp.array([[1, 1, 1, 0, 0, 0]])
  out = model.forward(cfg, params, tokens, segments, jnp.arange(6)[None], with_mtp=False,
                      cache=(cache.trunk_stacks, jnp.array([0]), jnp.zeros(1, jnp.int32)))
  written = np.abs(np.asarray(out["kv_cache"]["moe"][:, 0])).sum(-1)  # [Y, S]
  assert (written[:, :3] > 0).all() and (written[:, 3:] == 0).all()


def test_mtp_step_matches_training_mtp_head(small_cfg):
  cfg = small_cfg
  params, cache = _setup(cfg)
  tokens = jax.random.randint(jax.random.key(5), (1, 16), 0, cfg.vocab_size)
  expected = model.mtp_logits(cfg, params, tokens)[0, 0, :-1]  # depth 1; last has no next token
  trunk = _chunk(cfg, params, cache.trunk_stacks, tokens, jnp.array([0]),
                 jnp.zeros(1, jnp.int32))[0]
  stack, got = cache.stacks["mtp"], []
  for start, end in ((0, 7), (7, 8), (8, 15)):  # the MTP cache filled in uneven chunks
    t = end - start
    out = jax.jit(model.mtp_step, static_argnums=(0, 2))(
        cfg, params, 0, trunk["trunk_hidden"][:, start:end],
        tokens[:, start + 1:end + 1], jnp.ones((1, t), jnp.int32), start + jnp.arange(t)[None],
        stack, jnp.array([0]), jnp.full(1, start))
    stack = out["kv_cache"]
    got.append(out["hidden"][0] @ model.head_kernel(cfg, params))
  np.testing.assert_allclose(jnp.concatenate(got), expected, atol=TOL, rtol=0)
