"""Next-token targets and the shifts that line up MTP depths with the main head.

Shape glossary: B batch rows, T length.

Conventions (the data pipeline packs documents into rows):
  segment_ids [B,T] int   document id per position; 0 marks padding.
  loss_mask   [B,T] float 1 where the token *at* position t is a valid target (0 on prompts,
                          padding, tool output, ...). It marks targets, not inputs.
Shared by every phase's objective (c2/losses/lm.py) and by the model's MTP inputs.

Zig-zag batches (c2/data/zigzag.py, latent context parallelism) are permuted along T, so shifts
along T would pair the wrong tokens; they carry, per offset k, the token at t + k
(`next_tokens_k`) and the next-token weight of offset k (`next_weights_k`), computed in natural
order before the permutation. `batch_targets` and `lookahead_tokens` read those when present and
shift otherwise (natural order: the arrays are never made, the path is unchanged).
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


def lookahead_keys(offset: int) -> tuple[str, str]:
  """Batch keys of offset k's look-ahead arrays: (tokens at t + k, next-token weights)."""
  return f"next_tokens_{offset}", f"next_weights_{offset}"


def batch_targets(batch: dict, offset: int = 1) -> tuple[jax.Array, jax.Array]:
  """next_token_targets for a batch in either layout: (targets [B,T] int32, weights [B,T] f32)."""
  tokens_key, weights_key = lookahead_keys(offset)
  if weights_key not in batch:
    return next_token_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], offset)
  weights = batch[weights_key].astype(jnp.float32)
  return jnp.where(weights > 0, batch[tokens_key], 0).astype(jnp.int32), weights


def lookahead_tokens(batch: dict, offset: int) -> jax.Array:
  """The token at t + offset for every position [B,T] (zero past the row end), either layout."""
  tokens_key, _ = lookahead_keys(offset)
  return batch[tokens_key] if tokens_key in batch else shift_left(batch["tokens"], offset)
