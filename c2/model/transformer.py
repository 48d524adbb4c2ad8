"""The decoder: embed -> dense blocks -> MoE blocks -> final norm, plus DeepSeek-style MTP modules.

Glossary: B batch, T length, D model width, V vocabulary, K experts per token,
L MoE layers, M MTP depth.

This is the only module that holds the `ModelConfig`. It returns hidden states, not logits: the
loss library projects them onto the vocabulary in chunks so [B, T, V] float32 logits are never
materialised whole (V = 163,840 at full scale); `c2.model.head_kernel` is the [D, V] output
projection.

MTP module k (1-based), predicting token t+k+1 at position t:
  h'_k = eh_proj([enorm(embed(tokens[t + k])) ; hnorm(h_{k-1})])   embedding first, as checkpoints
  h_k  = Block_k(h'_k);  hidden_k = head_norm(h_k)                 h_0: last block, before norm
"""
from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2.losses.targets import shift_left
from c2.model.config import ModelConfig
from c2.model.block import BlockStack, DecoderBlock
from c2.model.router import DEFAULT_REPLAY_FALLBACK, ReplayFallback
from c2.model.layers import Embed, RMSNorm, default_init, logical_param
from c2.parallel.sharding import constrain


class MTPModule(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, prev_hidden, next_embeddings, segment_ids, positions, cache=None):
    """prev_hidden, next_embeddings [B, T, D] -> (h [B, T, D] pre-norm, normed hidden, aux).

    cache: None or a LayerCacheView (decoding); aux then holds the new `kv_entries` (or the
    written `kv_layer`, for a write-through view)."""
    cfg = self.cfg
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    norm = lambda name: RMSNorm(cfg.rms_norm_eps, dtype, param_dtype, name=name)
    d = cfg.hidden_size
    joined = jnp.concatenate([norm("enorm")(next_embeddings), norm("hnorm")(prev_hidden)], -1)
    eh_proj = logical_param(self, "eh_proj", (2 * d, d), (None, "embed"), default_init(),
                            param_dtype)
    h = jnp.einsum("BTX,XD->BTD", joined, eh_proj.astype(dtype))  # X = 2D
    h = constrain(h, ("batch", "length", "act_embed"))
    h, aux = DecoderBlock(cfg, use_moe=cfg.num_moe_layers > 0, name="block")(
        h, segment_ids, positions, None, cache)
    return h, norm("head_norm")(h), aux


class Transformer(nn.Module):
  cfg: ModelConfig
  replay_fallback: ReplayFallback = DEFAULT_REPLAY_FALLBACK  # how forced_routes fall back

  def setup(self):
    cfg = self.cfg
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype, param_dtype)
    if cfg.first_k_dense:
      self.dense_layers = BlockStack(cfg, use_moe=False, num_layers=cfg.first_k_dense)
    if cfg.num_moe_layers:
      self.moe_layers = BlockStack(cfg, use_moe=True, num_layers=cfg.num_moe_layers,
                                   replay_fallback=self.replay_fallback)
    self.final_norm = RMSNorm(cfg.rms_norm_eps, dtype, param_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = self.param("lm_head", nn.with_logical_partitioning(
          default_init(), ("embed", "vocab")), (cfg.hidden_size, cfg.vocab_size), param_dtype)
    self.mtp = [MTPModule(cfg, name=f"mtp_{k}") for k in range(cfg.mtp_depth)]

  def __call__(self, tokens: jax.Array, segment_ids: Optional[jax.Array] = None,
               positions: Optional[jax.Array] = None, forced_routes: Optional[jax.Array] = None,
               with_mtp: bool = True, detach_mtp_inputs: bool = False,
               cache: Optional[tuple] = None, mtp_tokens: Optional[list] = None) -> dict:
    """tokens [B, T] -> dict(hidden [B, T, D] final-normed, mtp_hidden [M, B, T, D], aux).

    segment_ids default to one document per row, positions to 0..T-1. forced_routes
    [L, B, T, K] replays recorded MoE routes (RL router replay) in the main layers; a replayed
    expert the router finds implausible falls back to its own choice under the module's
    `replay_fallback` rule (c2.model.router.replay_threshold).
    mtp_tokens: None, or per MTP depth k the token at t + k [B, T] (zig-zag rows, whose order
    makes shifting along T wrong: c2/data/zigzag.py); None shifts `tokens`.
    detach_mtp_inputs stops MTP gradients at the trunk's hidden state and the embeddings, so an
    MTP loss trains only the MTP modules (Composer 2 attaches MTP to a pretrained trunk).
    aux: moe/{load [L, E], balance_loss [L], routes [L, B, T, K], replay_override_rate [L]} and
    the same under mtp_moe.

    cache (decoding, c2/infer): (stacks {"dense": [Ld, slots, S, C], "moe": [L, slots, S, C]},
    rows [B] slot ids or None for all, lengths [B] tokens cached per row). Adds to the output
    `kv_cache` (the updated stacks) and `trunk_hidden` [B, T, D] (last block, before the final
    norm: the MTP modules' input); MTP is not run (c2.model.mtp_step drafts with it).
    """
    cfg = self.cfg
    b, t = tokens.shape
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = self.embed(tokens)
    aux, stacks = {}, {}
    stack_cache = lambda name: None if cache is None else (cache[0][name],) + tuple(cache[1:])
    if cfg.first_k_dense:
      x, dense_aux = self.dense_layers(x, segment_ids, positions, None, stack_cache("dense"))
      if cache is not None:
        stacks["dense"] = dense_aux["kv_cache"]
    if cfg.num_moe_layers:
      x, aux["moe"] = self.moe_layers(x, segment_ids, positions, forced_routes,
                                      stack_cache("moe"))
      if cache is not None:
        stacks["moe"] = aux["moe"].pop("kv_cache")
    out = {"hidden": self.final_norm(x), "aux": aux}
    if cache is not None:
      return {**out, "kv_cache": stacks, "trunk_hidden": x}
    if with_mtp and cfg.mtp_depth:
      maybe_detach = jax.lax.stop_gradient if detach_mtp_inputs else (lambda a: a)
      prev, mtp_hidden, mtp_aux = maybe_detach(x), [], []
      for k, module in enumerate(self.mtp, start=1):
        ahead = shift_left(tokens, k) if mtp_tokens is None else mtp_tokens[k - 1]
        next_embeddings = maybe_detach(self.embed(ahead))
        prev, normed, layer_aux = module(prev, next_embeddings, segment_ids, positions)
        mtp_hidden.append(normed)
        mtp_aux.append(layer_aux)
      out["mtp_hidden"] = jnp.stack(mtp_hidden)
      if cfg.num_moe_layers:
        aux["mtp_moe"] = jax.tree.map(lambda *a: jnp.stack(a), *mtp_aux)
    return out
