"""MoE router balance terms (DeepSeek-V3 §2.1.2; Kimi K2 routes the same way with one group).

Shape glossary: B batch rows, T length, E routed experts, K experts per token, L layers.

The aux-loss-free bias update, the complementary sequence-wise balance loss and load statistics.
The bias update is applied to the model's parameters by `c2.model.update_router_biases`.
"""
import jax
import jax.numpy as jnp


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
