"""Token-level losses shared by every training phase (pretraining, long-context, SFT, RL).

Shape glossary: B batch rows, T length, N flattened tokens (B*T), D model width, V vocab,
E routed experts, K experts per token, L layers.

Conventions (the data pipeline packs documents into rows):
  segment_ids [B,T] int   document id per position; 0 marks padding.
  loss_mask   [B,T] float 1 where the token *at* position t is a valid target (0 on prompts,
                          padding, tool output, ...). It marks targets, not inputs.

Every loss returns *sums* plus the weight sum rather than means: a step with gradient
accumulation or several data shards then divides once by the global weight sum, so the mean is
exact however the tokens were split. The output projection is folded into the loss (the caller
passes the final hidden states and the head kernel) because the [N,V] float32 logits of a
256k-token row with V=163840 would be ~170 GB; here only one chunk of logits is ever live, in the
forward and in the backward pass.

The MoE router terms (DeepSeek-V3 aux-loss-free bias update, sequence-wise balance loss, load
statistics) sit at the end. RL objectives (policy-gradient terms over per-token log-probs) will
join this module as further functions over the same chunked head.
"""
from typing import Callable

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


def _scan_over_token_chunks(chunk_fn: Callable[..., dict], inputs: tuple[jax.Array, ...],
                            consts: tuple[jax.Array, ...], chunk_size: int) -> dict:
  """Sums chunk_fn(*chunk_of_inputs, *consts) -> dict of scalars over chunks of the N axis.

  Padding rows (when N is not a multiple of chunk_size) are zeros, so every input whose zero
  value must not count (weights) has to be among `inputs`.

  The chunks are *strided*: chunk j holds tokens j, j + C, j + 2C, ... (C = number of chunks).
  When N is sharded over data-parallel devices in contiguous blocks, the reshape [N] ->
  [chunk_size, C] keeps that sharding on the first axis, so every scan step works on
  chunk_size / num_devices local tokens per device instead of one device doing the whole chunk
  while the others wait (what contiguous chunks would do). Sums do not care about the order.
  Keep chunk_size a multiple of the data-parallel device count for this to hold.

  jax.checkpoint makes the backward pass recompute each chunk's logits instead of saving them,
  so both passes hold one [chunk_size, V] float32 block at a time.
  """
  num_tokens = inputs[0].shape[0]
  chunk_size = max(1, min(chunk_size, num_tokens))
  num_chunks = -(-num_tokens // chunk_size)
  padded = num_chunks * chunk_size

  def to_chunks(x):
    x = jnp.pad(x, [(0, padded - num_tokens)] + [(0, 0)] * (x.ndim - 1))
    x = x.reshape((chunk_size, num_chunks) + x.shape[1:])  # [chunk, C, ...]
    return jnp.swapaxes(x, 0, 1)  # [C, chunk, ...]

  chunked = tuple(to_chunks(x) for x in inputs)
  step = jax.checkpoint(chunk_fn)

  def body(totals, chunk):
    stats = step(*chunk, *consts)
    return jax.tree.map(jnp.add, totals, stats), None

  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       jax.eval_shape(step, *(c[0] for c in chunked), *consts))
  totals, _ = jax.lax.scan(body, zeros, chunked)
  return totals


def _logits(hidden: jax.Array, head_kernel: jax.Array) -> jax.Array:
  """[n,D] x [D,V] -> [n,V] float32 logits; bf16 operands accumulate in float32."""
  return jnp.einsum("ND,DV->NV", hidden, head_kernel, preferred_element_type=jnp.float32)


def _pick(logits: jax.Array, index: jax.Array) -> jax.Array:
  """logits[n, index[n]] via a one-hot compare, not a gather: stays local when V is sharded."""
  vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
  return jnp.sum(jnp.where(vocab_ids == index[:, None], logits, 0.0), axis=-1)


def chunked_softmax_xent(hidden: jax.Array, head_kernel: jax.Array, targets: jax.Array,
                         weights: jax.Array, *, chunk_size: int,
                         z_loss_weight: float = 0.0) -> dict[str, jax.Array]:
  """Weighted softmax cross-entropy of the output head without materialising [N,V] logits.

  Args:
    hidden: [N,D] final (normed) hidden states, any float dtype.
    head_kernel: [D,V] output projection (pass lax.stop_gradient(kernel) to freeze it).
    targets: [N] int target ids.
    weights: [N] float per-token weights (0 = ignore).
    chunk_size: tokens per scan step (global, across data-parallel devices).
    z_loss_weight: coefficient of the PaLM z-loss, weight * logsumexp(logits)^2, which keeps the
      softmax normaliser near 1 so bf16 logits stay well conditioned.

  Returns:
    dict of float32 scalars: loss_sum = sum w * (lse - logit[target]);
    z_loss_sum = z_loss_weight * sum w * lse^2 (already weighted: add it to loss_sum);
    correct_sum = sum w * [argmax == target]; weight_sum = sum w.
  """
  def chunk_stats(h, t, w, kernel):
    logits = _logits(h, kernel)
    lse = jax.nn.logsumexp(logits, axis=-1)
    correct = (jnp.argmax(logits, axis=-1) == t).astype(jnp.float32)
    return {
        "loss_sum": jnp.sum(w * (lse - _pick(logits, t))),
        "z_loss_sum": z_loss_weight * jnp.sum(w * jnp.square(lse)),
        "correct_sum": jax.lax.stop_gradient(jnp.sum(w * correct)),
        "weight_sum": jax.lax.stop_gradient(jnp.sum(w)),
    }

  inputs = (hidden, targets.astype(jnp.int32), weights.astype(jnp.float32))
  return _scan_over_token_chunks(chunk_stats, inputs, (head_kernel,), chunk_size)


def chunked_distill_kl(student_hidden: jax.Array, teacher_hidden: jax.Array,
                       head_kernel: jax.Array, weights: jax.Array, *,
                       chunk_size: int) -> dict[str, jax.Array]:
  """MTP self-distillation: KL(teacher || student) through the shared output head, chunked.

  Composer 2 trains its MTP layers to reproduce the main head's logit distribution at the
  position that predicts the same token. With MTP depth k's hidden state at position t
  (predicting token t+1+k), the teacher is the main trunk's hidden state at position t+k:
  teacher_hidden = shift_left(main_hidden, k), weights from next_token_targets(offset=1+k).

  The teacher side is wrapped in stop_gradient (hidden and kernel), so only the student path
  gets gradient; to keep the shared head out of the distillation gradient as well, pass
  lax.stop_gradient(head_kernel).

  Args:
    student_hidden: [N,D] MTP hidden states (final-normed).
    teacher_hidden: [N,D] main-trunk hidden states aligned to the same target token.
    head_kernel: [D,V] shared output projection.
    weights: [N] float per-token weights.
    chunk_size: tokens per scan step.

  Returns:
    dict of float32 scalars: kl_sum = sum w * sum_v p_t (log p_t - log p_s);
    top1_agree_sum = sum w * [argmax p_s == argmax p_t];
    accept_sum = sum w * sum_v min(p_t, p_s), the expected acceptance rate of one drafted token
    under speculative sampling (1 - total variation), the number serving cares about;
    weight_sum = sum w.
  """
  def chunk_stats(h_student, h_teacher, w, kernel):
    teacher_logits = _logits(jax.lax.stop_gradient(h_teacher), jax.lax.stop_gradient(kernel))
    student_logits = _logits(h_student, kernel)
    log_p_teacher = jax.nn.log_softmax(teacher_logits, axis=-1)
    log_p_student = jax.nn.log_softmax(student_logits, axis=-1)
    p_teacher = jnp.exp(log_p_teacher)
    kl = jnp.sum(p_teacher * (log_p_teacher - log_p_student), axis=-1)
    agree = jnp.argmax(student_logits, -1) == jnp.argmax(teacher_logits, -1)
    accept = jnp.sum(jnp.minimum(p_teacher, jnp.exp(log_p_student)), axis=-1)
    return {
        "kl_sum": jnp.sum(w * kl),
        "top1_agree_sum": jax.lax.stop_gradient(jnp.sum(w * agree.astype(jnp.float32))),
        "accept_sum": jax.lax.stop_gradient(jnp.sum(w * accept)),
        "weight_sum": jax.lax.stop_gradient(jnp.sum(w)),
    }

  inputs = (student_hidden, teacher_hidden, weights.astype(jnp.float32))
  return _scan_over_token_chunks(chunk_stats, inputs, (head_kernel,), chunk_size)


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
