"""Output-head losses (main CE + z-loss, MTP self-distillation and CE) in one pass over token
chunks, with the gradients computed in that pass.

Glossary: N tokens (batch x length, flattened), D hidden, V vocabulary, M MTP depths, n tokens
in one chunk.

Why fused: logits for every token at once would be [N, V] float32 (V = 163,840 for Kimi), so the
head runs over token chunks. Autodiff of a chunked scan under jax.checkpoint recomputes each
chunk's logits in the backward pass, and separate main-CE / MTP-KL / MTP-CE passes project the
main hidden states twice (the KL's teacher is the main head). Here one chunk step projects the
main hidden states once and each MTP depth's once, and writes the gradients on the spot, since
d(loss)/d(logits) is closed form: d_hidden = dlogits W^T and d_W += h^T dlogits. Head matmuls per
token: main 3 (logits, d_hidden, d_W), each MTP depth 2 (+1 when its CE trains the head),
instead of 4 + 5 (+1 for the MTP CE metric) with autodiff: about half of the head's FLOPs.

The MTP hidden states come aligned to the main position whose next token they predict: depth k's
state at position n - k (see `align_mtp`), so a token's teacher distribution, target and student
share one chunk, and the MTP target is the main target.

Losses (w per-token weights, z logits, p = softmax(main), q_k = softmax(MTP depth k),
f_n = (1 - p_n[t_n])^focal_gamma held constant, 1 by default):
  main    sum_n w_n (f_n (lse_n - z_n[t_n]) + z_weight lse_n^2) / sum_n w_n
  mtp k   mtp_weight / M * sum_n w_kn ([distill] KL(p_n || q_kn) + [ce] (lse_kn - z_kn[t_n]))
          / sum_n w_kn
Gradients wrt logits (c = the weight over its normaliser, times mtp_weight / M for MTP):
  main    c_n (f_n (p_n - onehot(t_n)) + 2 z_weight lse_n p_n)
  mtp k   c_kn ([distill] (q_kn - p_n) + [ce] (q_kn - onehot(t_n)))   (teacher p is a constant)
The focal factor (Lin et al. 2017, here detached: a per-token weight, not differentiated) moves the
main term's gradient onto the tokens the model still gets wrong. In tool-use SFT nearly every
trained token is determined by its context and learned early, and the few that decide a task
(the new value in an edit's replacement) are a rounding error of the mean CE; see
experiments/sft.py. The CE metrics stay the plain CE.
The head gets gradient from the main loss, and from the MTP CE when `mtp_trains_head`; never from
the KL (that would pull the main head toward its own MTP student).

`weighted_only` projects only tokens that carry a weight (a weight or an MTP weight > 0): they are
gathered to the front (`weighted_first`), chunks holding none of them are skipped at run time,
and the hidden-state gradients are put back in place. SFT on tool-use transcripts trains ~15% of
a row (the environment's file contents are context only), RL likewise its sampled tokens. The
gather is over the whole token axis, so keep it off where tokens are sharded over a mesh.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class HeadLossSpec:
  chunk_size: int  # tokens per scan step, global (keep it a multiple of the data-parallel size)
  z_loss_weight: float = 0.0
  mtp_weight: float = 0.0
  mtp_distill: bool = True
  mtp_ce: bool = False
  mtp_trains_head: bool = True
  weighted_only: bool = False  # skip the chunks of tokens without weight (see the module doc)
  focal_gamma: float = 0.0  # main CE term scaled by the detached (1 - p_n(t_n))^gamma (0: plain)


def align_mtp(mtp_hidden: jax.Array, mtp_weights: jax.Array, depth: int):
  """Depth-k MTP tensors [B, T, ...] (position t predicts token t+1+k) -> aligned to the main
  position t+k that predicts the same token; the first k positions get zeros."""
  pad = lambda x: jnp.pad(x, [(0, 0), (depth, 0)] + [(0, 0)] * (x.ndim - 2))[:, :x.shape[1]]
  return pad(mtp_hidden), pad(mtp_weights)


def strided_chunks(x: jax.Array, chunk: int, num_chunks: int) -> jax.Array:
  """[N, ...] -> [C, n, ...] strided: chunk j holds tokens j, j + C, ... so a data-parallel
  sharding of N in contiguous blocks stays on the n axis (every device works on every step)."""
  padded = num_chunks * chunk
  x = jnp.pad(x, [(0, padded - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  return jnp.swapaxes(x.reshape((chunk, num_chunks) + x.shape[1:]), 0, 1)


def unchunk(x: jax.Array, num_tokens: int) -> jax.Array:
  """Inverse of strided_chunks: [C, n, ...] -> [N, ...]."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])[:num_tokens]


def weighted_first(active: jax.Array) -> tuple[jax.Array, jax.Array]:
  """For active [N] bool: (order [N], count): order lists the active tokens first, each group in
  its original order, and count is how many are active."""
  order = jnp.argsort(jnp.logical_not(active), stable=True)
  return order, jnp.sum(active.astype(jnp.int32))


def contiguous_chunks(x: jax.Array, chunk: int, num_chunks: int) -> jax.Array:
  """[N, ...] -> [C, n, ...]: chunk j holds tokens j * n ... (j + 1) * n - 1 (zero padded)."""
  x = jnp.pad(x, [(0, num_chunks * chunk - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  return x.reshape((num_chunks, chunk) + x.shape[1:])


def scatter_back(x: jax.Array, order: jax.Array) -> jax.Array:
  """Inverse of taking rows `order` of an [N, ...] array: rows return to their positions."""
  return jnp.zeros_like(x).at[order].set(x, unique_indices=True)


def _project(h, kernel):
  return jnp.einsum("ND,DV->NV", h, kernel, preferred_element_type=jnp.float32)  # [n,V]


def _chunk_step(spec: HeadLossSpec, with_grads: bool, kernel, h, t, w, c, s, ws, cs):
  """One chunk: h [n,D], t/w/c [n], s [n,M,D], ws/cs [n,M] -> (objective, metrics, grads)."""
  dtype = h.dtype
  logits = _project(h, kernel)
  lse = jax.nn.logsumexp(logits, axis=-1)  # [n]
  log_p = logits - lse[:, None]
  p = jnp.exp(log_p)
  onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == t[:, None]  # [n,V]
  target_logit = jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)
  argmax = jnp.argmax(logits, axis=-1)
  ce = lse - target_logit
  focal = (-jnp.expm1(-ce)) ** spec.focal_gamma if spec.focal_gamma else jnp.ones_like(ce)
  objective = jnp.sum(c * (focal * ce + spec.z_loss_weight * jnp.square(lse)))
  metrics = {"ce_sum": jnp.sum(w * ce), "z_loss_sum": spec.z_loss_weight * jnp.sum(w * lse**2),
             "correct_sum": jnp.sum(w * (argmax == t)), "weight_sum": jnp.sum(w)}
  grads = None
  if with_grads:
    d_logits = c[:, None] * (focal[:, None] * (p - onehot)
                             + 2.0 * spec.z_loss_weight * lse[:, None] * p)
    d_logits = d_logits.astype(dtype)
    d_h = jnp.einsum("NV,DV->ND", d_logits, kernel, preferred_element_type=jnp.float32)
    d_kernel = jnp.einsum("ND,NV->DV", h, d_logits, preferred_element_type=jnp.float32)
    d_s = []

  mtp = {"kl_sum": [], "top1_agree_sum": [], "accept_sum": [], "ce_sum": [], "weight_sum": []}
  for k in range(s.shape[1]):
    s_logits = _project(s[:, k], kernel)
    s_lse = jax.nn.logsumexp(s_logits, axis=-1)
    log_q = s_logits - s_lse[:, None]
    q = jnp.exp(log_q)
    kl = jnp.sum(p * (log_p - log_q), axis=-1)
    s_ce = s_lse - jnp.sum(jnp.where(onehot, s_logits, 0.0), axis=-1)
    objective += jnp.sum(cs[:, k] * (spec.mtp_distill * kl + spec.mtp_ce * s_ce))
    wk = ws[:, k]
    mtp["kl_sum"].append(jnp.sum(wk * kl))
    mtp["top1_agree_sum"].append(jnp.sum(wk * (jnp.argmax(s_logits, axis=-1) == argmax)))
    mtp["accept_sum"].append(jnp.sum(wk * jnp.sum(jnp.minimum(p, q), axis=-1)))
    mtp["ce_sum"].append(jnp.sum(wk * s_ce))
    mtp["weight_sum"].append(jnp.sum(wk))
    if with_grads:
      d_ce = cs[:, k, None] * (q - onehot) if spec.mtp_ce else 0.0
      d_s_logits = (cs[:, k, None] * (q - p) if spec.mtp_distill else 0.0) + d_ce
      d_s.append(jnp.einsum("NV,DV->ND", jnp.asarray(d_s_logits, dtype), kernel,
                            preferred_element_type=jnp.float32)
                 if (spec.mtp_distill or spec.mtp_ce) else jnp.zeros(h.shape, jnp.float32))
      if spec.mtp_ce and spec.mtp_trains_head:
        d_kernel += jnp.einsum("ND,NV->DV", s[:, k], d_ce.astype(dtype),
                               preferred_element_type=jnp.float32)
  metrics.update({f"mtp_{name}": jnp.stack(v) if v else jnp.zeros((0,), jnp.float32)
                  for name, v in mtp.items()})
  metrics = jax.tree.map(lambda x: x.astype(jnp.float32), metrics)
  if with_grads:
    d_s = jnp.stack(d_s, axis=1) if d_s else jnp.zeros(s.shape, jnp.float32)
    grads = (d_h, d_s, d_kernel)
  return objective, metrics, grads


def _run(spec: HeadLossSpec, with_grads: bool, hidden, mtp_hidden, kernel, targets, weights,
         coef, mtp_weights, mtp_coef):
  num_tokens = hidden.shape[0]
  chunk = max(1, min(spec.chunk_size, num_tokens))
  num_chunks = -(-num_tokens // chunk)
  per_token = (hidden, targets, weights, coef, mtp_hidden, mtp_weights, mtp_coef)
  if spec.weighted_only:
    order, count = weighted_first((weights > 0) | jnp.any(mtp_weights > 0, axis=1))
    chunked = [contiguous_chunks(jnp.take(x, order, axis=0), chunk, num_chunks)
               for x in per_token]
    # Chunk j runs when it holds an active token: only the first ceil(count / n) chunks do.
    runs = jnp.arange(num_chunks) * chunk < count
  else:
    chunked = [strided_chunks(x, chunk, num_chunks) for x in per_token]
    runs = jnp.ones((num_chunks,), bool)
  step = functools.partial(_chunk_step, spec, with_grads, kernel)
  shapes = jax.eval_shape(step, *(x[0] for x in chunked))
  zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
  init = (zeros(shapes[0]), zeros(shapes[1]))
  if with_grads:
    init += (jnp.zeros(kernel.shape, jnp.float32),)

  def body(carry, xs):
    run, xs = xs[0], xs[1:]
    if spec.weighted_only:
      objective, metrics, grads = jax.lax.cond(run, step, lambda *_: zeros(shapes), *xs)
    else:
      objective, metrics, grads = step(*xs)
    new = (carry[0] + objective, jax.tree.map(jnp.add, carry[1], metrics))
    if not with_grads:
      return new, None
    d_h, d_s, d_kernel = grads
    return new + (carry[2] + d_kernel,), (d_h.astype(hidden.dtype), d_s.astype(mtp_hidden.dtype))

  carry, per_chunk = jax.lax.scan(body, init, [runs] + chunked)
  if not with_grads:
    return carry[0], carry[1], None
  if spec.weighted_only:
    d_hidden, d_mtp = (scatter_back(x.reshape((num_chunks * chunk,) + x.shape[2:])[:num_tokens],
                                    order) for x in per_chunk)
  else:
    d_hidden, d_mtp = (unchunk(x, num_tokens) for x in per_chunk)
  return carry[0], carry[1], (d_hidden, d_mtp, carry[2].astype(kernel.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _objective(spec, hidden, mtp_hidden, kernel, targets, weights, coef, mtp_weights, mtp_coef):
  objective, metrics, _ = _run(spec, False, hidden, mtp_hidden, kernel, targets, weights, coef,
                               mtp_weights, mtp_coef)
  return objective, metrics


def _objective_fwd(spec, hidden, mtp_hidden, kernel, targets, weights, coef, mtp_weights,
                   mtp_coef):
  objective, metrics, grads = _run(spec, True, hidden, mtp_hidden, kernel, targets, weights,
                                   coef, mtp_weights, mtp_coef)
  return (objective, metrics), grads


def _objective_bwd(spec, grads, cotangents):
  del spec
  g = cotangents[0]  # metrics leave through stop_gradient: their cotangents are zero
  d_hidden, d_mtp, d_kernel = (x * g.astype(x.dtype) for x in grads)
  return d_hidden, d_mtp, d_kernel, None, None, None, None, None


_objective.defvjp(_objective_fwd, _objective_bwd)


def _normalised(weights: jax.Array, axis: int = 0) -> jax.Array:
  return weights / jnp.maximum(jnp.sum(weights, axis=axis, keepdims=True), 1.0)


def head_loss(spec: HeadLossSpec, hidden: jax.Array, head_kernel: jax.Array, targets: jax.Array,
              weights: jax.Array, mtp_hidden: Optional[jax.Array] = None,
              mtp_weights: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
  """The head's training objective and its metric sums.

  Args:
    spec: loss weights and switches (HeadLossSpec).
    hidden: [N, D] final-normed main hidden states.
    head_kernel: [D, V] output projection.
    targets: [N] int next-token ids; weights: [N] float per-token weights (0 = ignore).
    mtp_hidden: [N, M, D] MTP hidden states aligned to the main positions (align_mtp), or None.
    mtp_weights: [N, M] their per-token weights (aligned the same way).

  Returns:
    (objective, metrics): the scalar objective (differentiable wrt hidden, mtp_hidden and
    head_kernel), and float32 sums: ce_sum, z_loss_sum, correct_sum, weight_sum (scalars) and
    mtp_kl_sum, mtp_top1_agree_sum, mtp_accept_sum (expected acceptance of one drafted token,
    sum_v min(p, q)), mtp_ce_sum, mtp_weight_sum ([M] each). Metrics carry no gradient.
  """
  if mtp_hidden is None:
    mtp_hidden = jnp.zeros((hidden.shape[0], 0, hidden.shape[1]), hidden.dtype)
    mtp_weights = jnp.zeros((hidden.shape[0], 0), jnp.float32)
  weights = weights.astype(jnp.float32)
  mtp_weights = mtp_weights.astype(jnp.float32)
  depths = mtp_hidden.shape[1]
  coef = _normalised(weights)
  mtp_coef = _normalised(mtp_weights) * (spec.mtp_weight / max(depths, 1))
  objective, metrics = _objective(spec, hidden, mtp_hidden, head_kernel, targets.astype(jnp.int32),
                                  weights, coef, mtp_weights, mtp_coef)
  return objective, jax.lax.stop_gradient(metrics)
