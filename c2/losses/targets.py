"""Next-token targets and the shifts that line up MTP depths with the main head.

Shape glossary: B batch rows, T length.

Conventions (the data pipeline packs documents into rows):
  segment_ids [B,T] int   document id per position; 0 marks padding.
  loss_mask   [B,T] float 1 where the token *at* position t is a valid target (0 on prompts,
                          padding, tool output, ...). It marks targets, not inputs.
Shared by every phase's objective (c2/losses/lm.py) and by the model's MTP inputs.
"""
import jax
import jax.numpy as jnp


def shift_left(x: jax.Array, k: int) -> jax.Array:
  """Shifts x [B,T,...] left by k positions along T, filling the last k positions with zeros.

  out[:, t] = x[:, t + k]. Used to line up the main head at position t+k with MTP depth k at
  position t (both predict token t+1+k) and to build next-token targets.
  """
  if k < 0:
    raise ValueError(f"shift must be non-negative, got {k}")
  length = x.shape[1]
  if k == 0:
    return x
  if k >= length:
    return jnp.zeros_like(x)
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, k)
  return jnp.pad(x[:, k:], pad)


def next_token_targets(tokens: jax.Array, segment_ids: jax.Array, loss_mask: jax.Array,
                       offset: int = 1) -> tuple[jax.Array, jax.Array]:
  """Targets and weights for predicting the token `offset` positions ahead.

  Args:
    tokens: [B,T] int token ids.
    segment_ids: [B,T] int, 0 = padding.
    loss_mask: [B,T] float, 1 where the token at that position is a valid target.
    offset: 1 for the main head; 1 + k for MTP depth k.

  Returns:
    targets [B,T] int32 (tokens[t+offset], 0 where invalid) and weights [B,T] float32, which are
    loss_mask[t+offset] when position t and t+offset lie in the same non-padding document, else 0
    (so the last `offset` positions of every row and document get weight 0).
  """
  if offset < 1:
    raise ValueError(f"offset must be >= 1, got {offset}")
  targets = shift_left(tokens, offset).astype(jnp.int32)
  # Zero fill makes the shifted segment id 0 past the row end, so those positions fail the test.
  same_document = (shift_left(segment_ids, offset) == segment_ids) & (segment_ids != 0)
  weights = shift_left(loss_mask.astype(jnp.float32), offset) * same_document
  return jnp.where(weights > 0, targets, 0), weights
