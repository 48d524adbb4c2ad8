"""Pallas TPU kernels for the MoE layer: grouped matmuls in BF16 / FP8 / MXFP8 / NVFP4.

Public API:
  gmm(lhs, rhs, group_sizes, *, fmt, bwd_fmt, preferred_element_type)  [M,K]x[G,K,N] -> [M,N]
  tgmm(lhs, grad, group_sizes, *, fmt)                                  [M,K]^T[M,N] -> [G,K,N]
  quant.quantize / quant.dequantize / quant.fake_quant                   formats and scales
  reference.gmm / reference.tgmm / reference.gmm_vjp                     float32 specification
  tuning.use_target("v5p")                                               AOT for a TPU generation
Files: quant (formats), reference (spec), metadata (group work list), operands (kernel layouts),
gmm_kernel (Pallas bodies), tuning (generation + tile tables), ops (wrappers + VJP).
"""
from pallas_kernels import quant, reference, tuning
from pallas_kernels.ops import gmm, tgmm
from pallas_kernels.tuning import use_target

FORMATS = tuple(quant.FORMATS)

__all__ = ["gmm", "tgmm", "quant", "reference", "tuning", "use_target", "FORMATS"]
