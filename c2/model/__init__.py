"""The Kimi-K2.5 model: Linen modules, ModelConfig and presets, and the functional API below.

  from c2 import model
  params = model.init_params(cfg, rng, mesh); out = model.forward(cfg, params, tokens)
The modules (attention, block, moe, router, ...) are importable as c2.model.<module>.
"""
from c2.model.config import ModelConfig, get_preset
from c2.model.functional import (ROUTER_BIAS, abstract_boxed_params, abstract_params, build,
                                 forward, head_kernel, init_params, logits, mtp_logits, mtp_step,
                                 param_shardings, param_specs, router_biases, router_loads,
                                 unstack_layers, update_router_biases)

__all__ = ["ModelConfig", "get_preset", "ROUTER_BIAS", "abstract_boxed_params", "abstract_params",
           "build", "forward", "head_kernel", "init_params", "logits", "mtp_logits", "mtp_step",
           "param_shardings", "param_specs", "router_biases", "router_loads",
           "unstack_layers", "update_router_biases"]
