"""The one pluggable grouped-matmul op of the routed experts.

  grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]
Rows of `lhs` are sorted by group: rows [sum(gs[:g]), sum(gs[:g+1])) multiply rhs[g]; rows past
sum(group_sizes) give zeros. Implementations (same function, different cost):
  ragged_dot  jax.lax.ragged_dot: the default on GPU.
  dense       every row against every group, then select: G times the FLOPs, but one batched
              matmul; measured fastest on CPU for the tiny presets (see `python -m c2.bench moe`).
  pallas      `pallas_kernels.gmm` in a chosen format (bf16, fp8, mxfp8, nvfp4) with a separate
              backward format (Composer 2: NVFP4 forward, MXFP8 backward): the default on TPU.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from c2.parallel.mesh import target_platform


def resolve_impl(impl: str) -> str:
  """'auto' picks by the target platform: dense on CPU (tiny shapes, measured by `python -m
  c2.bench moe`), the Pallas kernels on TPU (XLA's TPU ragged_dot computes its weight gradient
  as a dense convolution over every group: G times the FLOPs, measured in
  tests/test_hlo_flops.py), ragged_dot elsewhere (GPU)."""
  if impl != "auto":
    return impl
  platform = target_platform()
  return {"cpu": "dense", "tpu": "pallas"}.get(platform, "ragged_dot")


def group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """Group index of each row [M] int32; rows past the last group get G (no group)."""
  ends = jnp.cumsum(group_sizes)
  return jnp.searchsorted(ends, jnp.arange(num_rows), side="right").astype(jnp.int32)


def _dense_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  g = rhs.shape[0]
  select = jax.nn.one_hot(group_ids(group_sizes, lhs.shape[0]), g, dtype=lhs.dtype)  # [M, G]
  every = jnp.einsum("MK,GKN->GMN", lhs, rhs, preferred_element_type=jnp.float32)
  return jnp.einsum("MG,GMN->MN", select.astype(jnp.float32), every)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, impl: str = "auto",
                   fmt: str = "bf16", bwd_fmt: Optional[str] = None,
                   expected_rows: Optional[int] = None) -> jax.Array:
  """See module docstring. Accumulates in float32; returns lhs.dtype.

  expected_rows: how many of the M rows are expected in groups (a capacity-bounded buffer is
  partly empty); only the Pallas kernels' cost estimates use it (their grids skip empty rows).
  """
  impl = resolve_impl(impl)
  group_sizes = group_sizes.astype(jnp.int32)
  if impl == "ragged_dot":
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
  elif impl == "dense":
    out = _dense_gmm(lhs, rhs, group_sizes)
  elif impl == "pallas":
    import pallas_kernels  # pylint: disable=import-outside-toplevel
    out = pallas_kernels.gmm(lhs, rhs, group_sizes, fmt=fmt, bwd_fmt=bwd_fmt,
                             preferred_element_type=jnp.float32, expected_rows=expected_rows)
  else:
    raise ValueError(f"unknown grouped-matmul impl {impl!r}")
  return out.astype(lhs.dtype)
