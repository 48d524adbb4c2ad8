"""c2/losses/targets.py: next-token targets and the shifts that align MTP depths."""
import jax.numpy as jnp
import numpy as np

from c2.losses import targets as targets_lib


def test_shift_left_zero_fills():
  x = jnp.arange(10).reshape(2, 5)
  np.testing.assert_array_equal(targets_lib.shift_left(x, 2), [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]])
  np.testing.assert_array_equal(targets_lib.shift_left(x, 0), x)
  np.testing.assert_array_equal(targets_lib.shift_left(x, 7), jnp.zeros_like(x))


def test_next_token_targets_respect_documents_padding_and_mask():
  tokens = jnp.array([[11, 12, 13, 21, 22, 23, 0, 0]])
  segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 0, 0]])
  # Token 22 (say a prompt token) is not a target; padding never is.
  loss_mask = jnp.array([[1, 1, 1, 1, 0, 1, 0, 0]], jnp.float32)
  targets, weights = targets_lib.next_token_targets(tokens, segment_ids, loss_mask)
  np.testing.assert_array_equal(targets, [[12, 13, 0, 0, 23, 0, 0, 0]])
  np.testing.assert_array_equal(weights, [[1, 1, 0, 0, 1, 0, 0, 0]])
  # MTP depth 1 predicts two ahead: only pairs inside one document survive.
  targets, weights = targets_lib.next_token_targets(tokens, segment_ids, loss_mask, offset=2)
  np.testing.assert_array_equal(targets, [[13, 0, 0, 23, 0, 0, 0, 0]])
  np.testing.assert_array_equal(weights, [[1, 0, 0, 1, 0, 0, 0, 0]])


def test_next_token_targets_last_positions_have_no_target():
  tokens = jnp.arange(1, 7).reshape(1, 6)
  ones = jnp.ones((1, 6))
  _, weights = targets_lib.next_token_targets(tokens, ones.astype(jnp.int32), ones, offset=3)
  np.testing.assert_array_equal(weights, [[1, 1, 1, 0, 0, 0]])


def test_shift_left_aligns_main_head_with_mtp_depth():
  # Main hidden at t+k and MTP depth k at t both predict token t+1+k.
  main = jnp.arange(6.0).reshape(1, 6, 1)
  np.testing.assert_array_equal(targets_lib.shift_left(main, 1)[0, :, 0], [1, 2, 3, 4, 5, 0])
