"""Public grouped matmuls: validation, padding, quantisation, tile choice and the custom VJP.

  gmm(lhs [M,K], rhs [G,K,N], group_sizes [G]) -> [M,N]
      out[m] = lhs[m] @ rhs[g] for the group g owning row m; rows past sum(group_sizes) are 0.
  tgmm(lhs [M,K], grad [M,N], group_sizes [G]) -> [G,K,N]
      out[g] = sum over rows m of group g of lhs[m]^T grad[m]; empty groups give 0.

fmt in {"bf16", "fp8", "mxfp8", "nvfp4"} (quant.py). Each operand is quantised along the
contraction axis of the matmul it feeds, in the wrapper (XLA fuses this with the padding), then
the kernel reads the low-precision values and scales. Shapes need not be tile multiples: the
wrappers zero-pad M, K, N up to the tiles and crop the result.

The VJP of gmm is straight-through (the quantisers count as identity) and runs in `bwd_fmt`:
  d_lhs [M,K] = gmm(grad [M,N], rhs^T [G,N,K])   # contracts N: grad, rhs quantised along N
  d_rhs [G,K,N] = tgmm(lhs [M,K], grad [M,N])     # contracts M: lhs, grad quantised along M
so Composer 2's split is gmm(..., fmt="nvfp4", bwd_fmt="mxfp8"). rhs^T is materialised for the
backward: for quantised bwd formats it fuses into the quantisation pass that writes a new copy
anyway; for bf16 it is one extra pass over the expert weights.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import gmm_kernel, metadata, operands, quant, tuning


def _pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  if x.shape == tuple(shape):
    return x
  return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


def _check(lhs, other, group_sizes, *, rhs_ndim: int, contract: tuple[int, int]):
  if lhs.ndim != 2 or other.ndim != rhs_ndim:
    raise ValueError(f"expected lhs 2-D and rhs {rhs_ndim}-D, got {lhs.shape} and {other.shape}")
  if lhs.shape[contract[0]] != other.shape[contract[1]]:
    raise ValueError(f"contraction mismatch: {lhs.shape} vs {other.shape}")
  if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be a 1-D integer array, got {group_sizes.dtype}"
                     f"{group_sizes.shape}")
  if rhs_ndim == 3 and group_sizes.shape[0] != other.shape[0]:
    raise ValueError(f"{group_sizes.shape[0]} group sizes for {other.shape[0]} groups")
  return group_sizes.astype(jnp.int32)


def _gmm_impl(lhs, rhs, group_sizes, fmt_name: str, out_dtype, gen: tuning.Generation,
              expected_rows: int | None = None):
  """Forward grouped matmul, no VJP. lhs [M,K], rhs [G,K,N] -> [M,N] out_dtype."""
  fmt = quant.get_format(fmt_name)
  (m, k), (g, _, n) = lhs.shape, rhs.shape
  tm, tk, tn = tuning.select_tiles("gmm", gen, m, k, n, g, fmt.name,
                                   jnp.dtype(out_dtype).itemsize)
  mp, kp, np_ = tuning.round_up(m, tm), tuning.round_up(k, tk), tuning.round_up(n, tn)
  packed = tuning.fp4_packed(gen, fmt.name)
  # Zero padding changes no row amax, so padding before quantising equals quantising first.
  lq = operands.lanes_operand(_pad_to(lhs, (mp, kp)), fmt, tk, packed)  # [Mp, Kp] along K
  rq = operands.sublanes_operand(_pad_to(rhs, (g, kp, np_)), fmt, tk, packed)  # along K
  meta, num_items = metadata.make_group_metadata(
      group_sizes, num_rows=m, tm=tm, num_m_tiles=mp // tm, for_tgmm=False)
  out = gmm_kernel.gmm_call(
      meta, num_items, lq, rq, fmt=fmt, tiles=(tm, tk, tn),
      out_shape=(mp, np_), out_dtype=jnp.dtype(out_dtype),
      mxu_dtype=tuning.mxu_dtype(gen, fmt.name), packed=packed, interpret=gen.interpret,
      vmem_limit_bytes=gen.vmem_limit_bytes, mxu_side=gen.mxu_side, cost_rows=expected_rows)
  return out[:m, :n]


def _tgmm_impl(lhs, grad, group_sizes, fmt_name: str, out_dtype, gen: tuning.Generation,
               expected_rows: int | None = None):
  """Transposed grouped matmul. lhs [M,K], grad [M,N] -> [G,K,N] out_dtype."""
  fmt = quant.get_format(fmt_name)
  (m, k), n, g = lhs.shape, grad.shape[1], group_sizes.shape[0]
  tm, tk, tn = tuning.select_tiles("tgmm", gen, m, k, n, g, fmt.name,
                                   jnp.dtype(out_dtype).itemsize)
  mp, kp, np_ = tuning.round_up(m, tm), tuning.round_up(k, tk), tuning.round_up(n, tn)
  packed = tuning.fp4_packed(gen, fmt.name)
  lq = operands.sublanes_operand(_pad_to(lhs, (mp, kp)), fmt, tm, packed, rows_last=True)
  gq = operands.sublanes_operand(_pad_to(grad, (mp, np_)), fmt, tm, packed)  # both along M
  meta, num_items = metadata.make_group_metadata(
      group_sizes, num_rows=m, tm=tm, num_m_tiles=mp // tm, for_tgmm=True)
  out = gmm_kernel.tgmm_call(
      meta, num_items, lq, gq, fmt=fmt, tiles=(tm, tk, tn), num_groups=g,
      out_dtype=jnp.dtype(out_dtype), mxu_dtype=tuning.mxu_dtype(gen, fmt.name), packed=packed,
      interpret=gen.interpret, vmem_limit_bytes=gen.vmem_limit_bytes, mxu_side=gen.mxu_side,
      cost_rows=expected_rows)
  return out[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _gmm(lhs, rhs, group_sizes, fmt, bwd_fmt, out_dtype, gen, expected_rows):
  return _gmm_impl(lhs, rhs, group_sizes, fmt, out_dtype, gen, expected_rows)


def _gmm_fwd(lhs, rhs, group_sizes, fmt, bwd_fmt, out_dtype, gen, expected_rows):
  # Residuals are the unquantised inputs: the backward re-quantises along other axes.
  return (_gmm_impl(lhs, rhs, group_sizes, fmt, out_dtype, gen, expected_rows),
          (lhs, rhs, group_sizes))


def _gmm_bwd(fmt, bwd_fmt, out_dtype, gen, expected_rows, residuals, grad):
  lhs, rhs, group_sizes = residuals
  with jax.named_scope("gmm_dlhs"):
    d_lhs = _gmm_impl(grad, jnp.swapaxes(rhs, 1, 2), group_sizes, bwd_fmt, lhs.dtype, gen,
                      expected_rows)
  with jax.named_scope("gmm_drhs"):
    d_rhs = _tgmm_impl(lhs, grad, group_sizes, bwd_fmt, rhs.dtype, gen, expected_rows)
  return d_lhs, d_rhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, fmt: str = "bf16",
        bwd_fmt: str | None = None, preferred_element_type=None,
        target: str | tuning.Generation | None = None,
        expected_rows: int | None = None) -> jax.Array:
  """Grouped matmul lhs [M,K] x rhs [G,K,N] -> [M,N], differentiable in lhs and rhs.

  group_sizes: int [G], sum <= M; rows of lhs are contiguous by group. fmt: forward format;
  bwd_fmt: format of both backward matmuls (default fmt). Output dtype is lhs.dtype unless
  preferred_element_type is given; accumulation is float32. target: TPU generation to compile
  for ("v5e", "v5p", "v6e", "tpu7x", or "cpu" for interpret mode); default: tuning.use_target's,
  else the default backend's (interpret mode on any non-TPU backend). expected_rows: rows expected
  in groups (default M), for the kernels' cost estimates only: the grid skips rows in no group.
  """
  group_sizes = _check(lhs, rhs, group_sizes, rhs_ndim=3, contract=(1, 1))
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  fmt = quant.get_format(fmt).name
  bwd_fmt = quant.get_format(bwd_fmt or fmt).name
  with jax.named_scope(f"gmm_{fmt}"):
    return _gmm(lhs, rhs, group_sizes, fmt, bwd_fmt, out_dtype, tuning.get_generation(target),
                expected_rows)


def tgmm(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array, *, fmt: str = "bf16",
         preferred_element_type=None, target: str | tuning.Generation | None = None,
         expected_rows: int | None = None) -> jax.Array:
  """Transposed grouped matmul lhs [M,K]^T x grad [M,N] per group -> [G,K,N] (weight gradient).

  Both inputs are quantised along M (the contraction). Output dtype is lhs.dtype unless
  preferred_element_type is given. Not differentiable (it is itself a gradient). expected_rows:
  as for gmm.
  """
  group_sizes = _check(lhs, grad, group_sizes, rhs_ndim=2, contract=(0, 0))
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  fmt = quant.get_format(fmt).name
  with jax.named_scope(f"tgmm_{fmt}"):
    return _tgmm_impl(lhs, grad, group_sizes, fmt, out_dtype, tuning.get_generation(target),
                      expected_rows)
