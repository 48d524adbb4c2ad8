"""Speculative sampling's acceptance rule (Leviathan et al. 2023; Chen et al. 2023).

Glossary: B rows, D drafted tokens, V vocabulary.

Drafts d_1..d_D were drawn from the draft distributions q_1..q_D (the MTP modules'); one forward
of the main model over [last token, d_1..d_D] gives the target distributions p_1..p_{D+1}. Draft j
is accepted with probability min(1, p_j(d_j) / q_j(d_j)), in order, stopping at the first
rejection; the rejected position instead draws from norm(max(0, p_j - q_j)); if all D are
accepted a bonus token is drawn from p_{D+1}. Each emitted token is then distributed exactly as
plain sampling from p would have drawn it. With greedy rows p and q are point masses, so a draft is
accepted iff it equals the target argmax and the correction is that argmax: output identical to
plain greedy decoding.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from c2.infer import sampling


def accept(target: jax.Array, draft: jax.Array, drafts: jax.Array, seeds: jax.Array,
           positions: jax.Array, temperature: Optional[jax.Array] = None
           ) -> tuple[jax.Array, jax.Array]:
  """Runs the acceptance rule.

  target [B, D + 1, V], draft [B, D, V]: sampling log-probs (c2.infer.sampling); drafts [B, D];
  seeds [B]; positions [B]: the position d_1 would take (keys depend on position + j);
  temperature [B] (optional): lets an all-greedy batch skip the final draw's noise.
  -> (num_accepted [B] int32 in 0..D, tokens [B, D + 1]: the accepted drafts, then the
  correction or bonus token at index num_accepted; entries after it are meaningless).
  """
  b, d, v = draft.shape
  take = lambda logp, ids: jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]
  p_of_draft = take(target[:, :d], drafts)  # [B, D] log p_j(d_j)
  q_of_draft = take(draft, drafts)  # [B, D]
  uniforms = jnp.stack([
      jax.vmap(lambda key: jax.random.uniform(key))(
          sampling.row_keys(seeds, positions + j, sampling.ACCEPT)) for j in range(d)], axis=1)
  # u < p/q, in log space; p/q >= 1 always accepts (log u < 0 <= log p - log q).
  accepted = jnp.log(uniforms) < p_of_draft - q_of_draft  # [B, D]
  num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # [B]

  # The distribution of the token at index num_accepted: residual after a rejection, p_{D+1}
  # (bonus) after D acceptances.
  p_next = jnp.take_along_axis(target, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
  q_next = jnp.take_along_axis(
      jnp.concatenate([draft, jnp.full((b, 1, v), -jnp.inf, draft.dtype)], axis=1),
      num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]; -inf (q = 0) for the bonus
  residual = jnp.maximum(jnp.exp(p_next) - jnp.exp(q_next), 0.0)
  # Rounding can leave an all-zero residual when p == q exactly (then no rejection could have
  # happened in exact arithmetic); fall back to p.
  residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, jnp.exp(p_next))
  final_positions = positions + num_accepted
  if temperature is None:
    final_token = sampling.draw(jnp.log(residual), sampling.row_keys(
        seeds, final_positions, sampling.RESIDUAL))
  else:
    final_token = sampling.draw_tokens(jnp.log(residual), temperature, seeds, final_positions,
                                       sampling.RESIDUAL)
  tokens = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
  tokens = tokens.at[jnp.arange(b), num_accepted].set(final_token)
  return num_accepted.astype(jnp.int32), tokens.astype(jnp.int32)
