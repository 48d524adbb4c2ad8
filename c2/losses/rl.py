"""The RL learner's objective on a packed batch of rollouts: the model forward with router replay,
per-token log-probs of the sampled tokens through the chunked head, and the policy-gradient loss
of c2/losses/policy_gradient.py.

Glossary: B rows, T length, N = B * T tokens, V vocabulary, Y MoE layers, K experts per token.

Batch (per-token arrays are indexed by the token they describe, like `loss_mask`):
  tokens, segment_ids, positions  [B, T] int32   packed rollout segments (0 segment = padding)
  loss_mask        [B, T] float  1 on model tokens (sampled by the policy), 0 on prompt/env tokens
  advantages       [B, T] float  the chain's advantage on its model tokens (token_advantages)
  sampler_logp     [B, T] float  the sampler's float32 log-prob of each sampled token
  ref_logp         [B, T] float  optional: the reference policy's log-prob (k1 KL)
  forced_routes    [Y, B, T, K] int32 optional: the sampler's recorded experts (router replay;
                   NOT_RECORDED = -1 rows route themselves)
The head at position t predicts token t + 1, so every per-token array is shifted left by one to
line up with the position that predicts it (c2.losses.targets).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from c2 import model as model_lib
from c2.losses import head as head_lib
from c2.losses import policy_gradient as pg
from c2.losses import targets as targets_lib
from c2.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class RLLossWeights:
  """Plain numbers of the RL objective (built by the RL trainer from its config)."""

  normalizer: float  # constant for the run (Dr. GRPO), e.g. max tokens per rollout * batch rows
  chunk_size: int = 2048  # tokens per head chunk
  kl_coef: float = 0.0
  kl_placement: str = "reward"  # reward | loss | none
  is_cap: Optional[float] = None  # truncated importance weights pi_train / pi_sampler
  replay_fallback: Any = "rank"  # c2.model.router.replay_threshold rule ("off": verbatim replay)
  weighted_only: bool = False  # project only the model tokens (token_logprobs' `active`)
  # Positions whose next-token entropy under the learner (nats, detached) is below this get no
  # policy gradient (0: off). Why: at a near-deterministic position (a format token) the sampled
  # token's score is tiny but its sign follows the rollout's advantage, and failing rollouts make
  # more turns, so these tokens are pushed down step after step; the rare samples that would
  # balance that in expectation almost never come. Measured on the tiny pipeline (README,
  # "Agentic RL"): at lr 3e-4 the policy lost its "Next step:" turn opening (31 of 32 rollouts
  # ended without a parsable tool call); gated at 0.3 nats the format held, but the pass rate
  # did not rise either. Training only the uncertain positions follows Wang et al. 2025 ("Beyond
  # the 80/20 rule: high-entropy minority tokens drive effective RL").
  min_entropy: float = 0.0


def token_logprobs(hidden: jax.Array, head_kernel: jax.Array, targets: jax.Array,
                   chunk_size: int, active: Optional[jax.Array] = None,
                   with_entropy: bool = False):
  """log softmax(hidden @ W)[target] for hidden [N, D], targets [N] -> float32 [N], differentiable
  (with_entropy: and the entropy of each softmax in nats, float32 [N], detached, as a pair).

  Over token chunks under jax.checkpoint: the [N, V] logits never exist at once, and the backward
  pass recomputes one chunk's logits at a time (V = 163,840 at full scale). With `active` [N]
  bool, only the active tokens are projected (gathered to the front, chunks without one skipped;
  head_lib's `weighted_only`) and the others get 0."""
  n = hidden.shape[0]
  chunk = min(chunk_size, n)
  num_chunks = -(-n // chunk)
  if active is None:
    # Strided chunks (chunk j holds tokens j, j + C, ...), as the LM head loss does: a batch
    # sharded in contiguous blocks of tokens stays sharded on each chunk's token axis, so every
    # device works on every chunk and nothing is gathered.
    h = head_lib.strided_chunks(hidden, chunk, num_chunks)  # [C, n, D]
    t = head_lib.strided_chunks(targets.astype(jnp.int32), chunk, num_chunks)  # [C, n]
  else:
    order, count = head_lib.weighted_first(active)
    h, t = (head_lib.contiguous_chunks(jnp.take(x, order, axis=0), chunk, num_chunks)
            for x in (hidden, targets.astype(jnp.int32)))
    runs = jnp.arange(num_chunks) * chunk < count  # [C]: chunks holding an active token

  def logp(h_c, t_c):
    logits = jnp.einsum("nD,DV->nV", h_c.astype(jnp.float32), head_kernel.astype(jnp.float32))
    log_probs = jax.nn.log_softmax(logits)  # [n, V]
    picked = jnp.take_along_axis(log_probs, t_c[:, None], axis=-1)[:, 0]
    if not with_entropy:
      return picked
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return picked, jax.lax.stop_gradient(entropy)

  if active is None:
    out = jax.lax.map(jax.checkpoint(lambda a: logp(*a)), (h, t))
    return jax.tree.map(lambda x: head_lib.unchunk(x, n), out)
  skipped = lambda h_c, t_c: ((jnp.zeros(t_c.shape, jnp.float32),) * 2 if with_entropy
                              else jnp.zeros(t_c.shape, jnp.float32))
  one = jax.checkpoint(lambda a: jax.lax.cond(a[0], logp, skipped, a[1], a[2]))
  out = jax.lax.map(one, (runs, h, t))
  # The last chunk run may hold inactive tokens: they get 0.
  back = lambda x: jnp.where(active, head_lib.scatter_back(x.reshape(-1)[:n], order), 0.0)
  return jax.tree.map(back, out)


def _forward_logprobs(cfg: ModelConfig, params: Any, batch: dict, weights: RLLossWeights,
                      with_entropy: bool = False):
  """-> (model outputs, logp [B, T] of each position's next token, its mask); with_entropy:
  logp is a pair (logp, entropy [B, T] of each position's next-token distribution)."""
  tokens, segments = batch["tokens"], batch["segment_ids"]
  out = model_lib.forward(cfg, params, tokens, segments, batch["positions"],
                          batch.get("forced_routes"), with_mtp=False,
                          replay_fallback=weights.replay_fallback)
  targets, mask = targets_lib.next_token_targets(tokens, segments, batch["loss_mask"], offset=1)
  b, t = tokens.shape
  logp = token_logprobs(out["hidden"].reshape(b * t, -1), model_lib.head_kernel(cfg, params),
                        targets.reshape(-1), weights.chunk_size,
                        mask.reshape(-1) > 0 if weights.weighted_only else None, with_entropy)
  return out, jax.tree.map(lambda x: x.reshape(b, t), logp), mask


def reference_logprobs(cfg: ModelConfig, params: Any, batch: dict, weights: RLLossWeights
                       ) -> jax.Array:
  """float32 [B, T]: log-prob of every model token under `params` (the reference policy), indexed
  by the token like `sampler_logp` (0 on other tokens), with the same router replay; the batch's
  `ref_logp` for the k1 KL term."""
  _, logp, mask = _forward_logprobs(cfg, params, batch, weights)
  by_token = jnp.pad(logp * mask, ((0, 0), (1, 0)))[:, :-1]  # position t predicts token t + 1
  return jax.lax.stop_gradient(by_token)


def rl_loss(cfg: ModelConfig, params: Any, batch: dict, weights: RLLossWeights
            ) -> tuple[jax.Array, dict]:
  """-> (loss, aux): aux["metrics"] (policy-gradient metrics, replay override rate) and, for MoE
  models, aux["router_load"] for the aux-loss-free bias update (as the LM objective)."""
  gate = weights.min_entropy > 0
  out, logp, mask = _forward_logprobs(cfg, params, batch, weights, with_entropy=gate)
  logp, entropy = logp if gate else (logp, None)
  ahead = lambda name: targets_lib.shift_left(batch[name].astype(jnp.float32), 1)
  ref = ahead("ref_logp") if "ref_logp" in batch else None
  loss, metrics = pg.policy_gradient_loss(
      logp, ahead("sampler_logp"), ahead("advantages"), mask, normalizer=weights.normalizer,
      ref_logp=ref, kl_coef=weights.kl_coef, kl_placement=weights.kl_placement,
      is_cap=weights.is_cap,
      pg_mask=None if entropy is None else (entropy >= weights.min_entropy).astype(jnp.float32))
  if entropy is not None:
    metrics["entropy_mean"] = jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  metrics = {f"rl/{name}": value for name, value in metrics.items()}
  aux = {"metrics": metrics, "logp": jax.lax.stop_gradient(logp)}
  if cfg.num_moe_layers:
    moe = out["aux"]["moe"]
    if "replay_override_rate" in moe:
      metrics["rl/replay_override_rate"] = jnp.mean(moe["replay_override_rate"])
    aux["router_load"] = model_lib.router_loads(out["aux"])
  metrics["loss"] = loss
  return loss, aux
