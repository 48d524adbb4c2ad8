"""Inference: latent-KV-cache engine with continuous batching and MTP speculative decoding.

  from c2.infer import Engine, Request, SamplingParams
"""
from c2.infer.engine import Engine, Request, Result, TokenEvent, forced_routes
from c2.infer.sampling import SamplingParams

__all__ = ["Engine", "Request", "Result", "SamplingParams", "TokenEvent", "forced_routes"]
