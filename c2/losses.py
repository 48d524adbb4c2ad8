"""Token-level losses shared by every training phase (pretraining, long-context, SFT, RL).

Shape glossary: B batch rows, T length, N flattened tokens (B*T), D model width, V vocab,
E routed experts, K experts per token, L layers.

Conventions (the data pipeline packs documents into rows):
  segment_ids [B,T] int   document id per position; 0 marks padding.
  loss_mask   [B,T] float 1 where the token *at* position t is a valid target (0 on prompts,
                          padding, tool output, ...). It marks targets, not inputs.

Here: next-token targets and the shifts that align MTP depths, and the MoE router terms
(DeepSeek-V3 aux-loss-free bias update, sequence-wise balance loss, load statistics). The output
head's losses (CE, z-loss, MTP self-distillation), chunked over tokens with the gradients
computed in the same pass, are in c2/head_loss.py.
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


# ---------------------------------------------------------------------------------------------
# MoE router balance (DeepSeek-V3 §2.1.2; Kimi K2 routes the same way with one expert group).


def expert_counts(topk_idx: jax.Array, token_mask: jax.Array, *, num_experts: int) -> jax.Array:
  """Tokens routed to each expert: topk_idx [...,K] int, token_mask [...] -> [E] float32.

  A bincount rather than a one-hot sum: the one-hot would be [tokens, K, E], ~0.1 G elements for
  one 32k row with K=8, E=384. vmap over a leading layer axis to get [L,E].
  """
  mask = jnp.broadcast_to(token_mask.astype(jnp.float32)[..., None], topk_idx.shape)
  return jnp.bincount(topk_idx.reshape(-1), weights=mask.reshape(-1), length=num_experts)


def aux_free_bias_update(bias: jax.Array, load: jax.Array, *, rate: float) -> jax.Array:
  """One step of the aux-loss-free balancing rule; no gradient flows through it.

  b_e <- b_e + rate * sign(mean_e(load) - load_e): overloaded experts become less likely to be
  selected (the bias only affects top-k selection, never the combine weights). Call once per
  optimizer step with the load summed over the whole global batch (expert_counts;
  DeepSeek-V3: rate 1e-3, then 0 for the final tokens).

  Args:
    bias: [L,E] float32 router correction bias (any leading dims).
    load: [L,E] tokens per expert over the step.
    rate: bias step size (gamma).

  Returns:
    new bias, same shape and dtype as `bias`.
  """
  load = jax.lax.stop_gradient(load.astype(jnp.float32))
  direction = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
  return (jax.lax.stop_gradient(bias) + rate * direction).astype(bias.dtype)


def sequence_balance_loss(scores: jax.Array, topk_idx: jax.Array, token_mask: jax.Array, *,
                          num_experts: int, top_k: int) -> jax.Array:
  """DeepSeek-V3 complementary sequence-wise balance loss, without the alpha factor.

  Per row b with T_b valid tokens:
    f_e = E / (K * T_b) * #{t : e in topk(t)}         (no gradient: selection is discrete)
    P_e = 1 / T_b * sum_t s_{e,t} / sum_j s_{j,t}     (normalised sigmoid affinities)
    loss_b = sum_e f_e * P_e
  and the result is the mean of loss_b over rows with T_b > 0. A perfectly balanced row gives
  exactly 1; collapse onto K experts pushes it towards E / K. Multiply by alpha (V3: 1e-4).

  Packed rows are treated as one sequence each (as Megatron's seq_aux does); documents inside a
  row are not separated.

  Args:
    scores: [B,T,E] sigmoid router affinities s (before the selection bias).
    topk_idx: [B,T,K] int selected experts.
    token_mask: [B,T] 1 for real tokens, 0 for padding.
    num_experts: E.
    top_k: K.

  Returns:
    float32 scalar.
  """
  mask = token_mask.astype(jnp.float32)
  tokens_per_row = jnp.sum(mask, axis=-1)  # [B]
  safe_tokens = jnp.maximum(tokens_per_row, 1.0)
  counts = jax.vmap(lambda idx, m: expert_counts(idx, m, num_experts=num_experts))(
      topk_idx, mask)  # [B,E]
  fraction = jax.lax.stop_gradient(counts * num_experts / (top_k * safe_tokens[:, None]))
  scores = scores.astype(jnp.float32)
  normalised = scores / jnp.maximum(jnp.sum(scores, axis=-1, keepdims=True), 1e-20)
  mean_affinity = jnp.einsum("BTE,BT->BE", normalised, mask) / safe_tokens[:, None]
  per_row = jnp.sum(fraction * mean_affinity, axis=-1)  # [B]
  has_tokens = (tokens_per_row > 0).astype(jnp.float32)
  return jnp.sum(per_row * has_tokens) / jnp.maximum(jnp.sum(has_tokens), 1.0)


def load_stats(load: jax.Array) -> dict[str, jax.Array]:
  """Balance statistics of per-expert load [...,E] over the last axis (leading dims kept).

  Returns dict of float32 arrays [...]: max_over_mean (1 = balanced; the number that sets
  expert-parallel step time), entropy in nats of the normalised load (log E = balanced), and cv
  (coefficient of variation, std / mean).
  """
  load = load.astype(jnp.float32)
  mean = jnp.mean(load, axis=-1)
  safe_mean = jnp.maximum(mean, 1e-20)
  share = load / jnp.maximum(jnp.sum(load, axis=-1, keepdims=True), 1e-20)
  entropy = -jnp.sum(jnp.where(share > 0, share * jnp.log(jnp.maximum(share, 1e-30)), 0.0), -1)
  return {
      "max_over_mean": jnp.max(load, axis=-1) / safe_mean,
      "entropy": entropy,
      "cv": jnp.std(load, axis=-1) / safe_mean,
  }
