"""Per-TPU-generation facts and tile tables for the grouped matmuls.

What differs between generations, and where the numbers come from:
* native_mxu_dtypes: element types the MXU multiplies without a cast. float8_e4m3fn is native only
  on TPU7x (jax's pltpu TpuInfo.is_matmul_supported; v5e/v5p/v6e list e5m2 and e4m3b11fnuz, not
  e4m3fn, and Google's docs give them no FP8 rate). Mosaic *accepts* e4m3fn operands on v5e/v5p/
  v6e too (tests/pallas_kernels/test_aot.py), but then it only casts, so we cast ourselves.
  No TPU has a block-scaled MXU mode, so MXFP8/NVFP4 always dequantise in VMEM (see gmm_kernel).
* fp4_in_vmem: Mosaic can load float4_e2m1fn blocks only on TPU7x ("Unsupported type
  vector<...xf4E2M1FN>" on v5e/v5p/v6e). Elsewhere NVFP4 values travel as two codes per uint8
  and are decoded in VMEM, so HBM traffic stays at 4 bits per element either way.
* vmem_limit_bytes: the scoped-VMEM limit we ask Mosaic for; VMEM is 128 MiB per core on v5e and
  v6e, 64 MiB on v5p and TPU7x (TpuInfo). We take half, leaving room for Mosaic's own scratch.
* tiles: (tm, tk, tn) starting points, NOT measured on hardware (no TPU was available). Chosen so
  a tile's arithmetic intensity tm*tn/(tm+tn) (bf16 flops/byte) clears each chip's ridge point
  (peak flops / HBM bandwidth: v5e ~240, v5p ~170, v6e ~560, TPU7x ~310 per core) while the
  double-buffered tiles plus dequant temporaries fit the VMEM limit. Keyed by the average rows per
  group (M/G): small groups waste most of a tall row tile, so they get a shorter tm.
The "cpu" generation runs kernels in interpret mode (any non-TPU backend); it also keeps
e4m3fn native (XLA:CPU dots accept it) so tests exercise both MXU paths.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

from pallas_kernels import quant

MIB = 1 << 20
ALIGN = 128  # every tile dimension is a multiple of the 128-lane vreg width


@dataclasses.dataclass(frozen=True)
class Generation:
  name: str
  interpret: bool
  native_mxu_dtypes: frozenset[str]
  fp4_in_vmem: bool
  vmem_limit_bytes: int
  # Rows of (max average rows per group, (tm, tk, tn)); the first matching row wins.
  gmm_tiles: tuple[tuple[float, tuple[int, int, int]], ...]
  tgmm_tiles: tuple[tuple[float, tuple[int, int, int]], ...]
  # The MXU's side (128 x 128 on v5e/v5p, 256 x 256 on v6e/TPU7x): the row slab the kernels
  # compute a group-boundary tile in (gmm_kernel), which is also tgmm's contraction depth there.
  mxu_side: int = 128


_E4M3 = frozenset({"float8_e4m3fn"})
_SMALL_GROUPS = 512.0  # average rows per group below which a 128/256-row tile wastes less
_INF = float("inf")

GENERATIONS: dict[str, Generation] = {
    # Interpret mode: fewer, larger grid steps run faster; nothing here is hardware-bound.
    "cpu": Generation(
        "cpu", True, _E4M3, False, 64 * MIB,
        gmm_tiles=((_INF, (256, 512, 512)),),
        tgmm_tiles=((_INF, (256, 512, 512)),)),
    "v5e": Generation(
        "v5e", False, frozenset(), False, 64 * MIB,
        gmm_tiles=((_SMALL_GROUPS, (256, 1024, 1024)), (_INF, (512, 1024, 1024))),
        tgmm_tiles=((_INF, (512, 1024, 1024)),)),
    "v5p": Generation(
        "v5p", False, frozenset(), False, 32 * MIB,
        gmm_tiles=((_SMALL_GROUPS, (256, 1024, 512)), (_INF, (512, 1024, 512))),
        tgmm_tiles=((_INF, (512, 512, 512)),)),
    "v6e": Generation(
        "v6e", False, frozenset(), False, 64 * MIB,
        gmm_tiles=((_SMALL_GROUPS, (256, 1024, 2048)), (_INF, (512, 1024, 2048))),
        tgmm_tiles=((_INF, (512, 1024, 1024)),), mxu_side=256),
    "tpu7x": Generation(
        "tpu7x", False, _E4M3, True, 32 * MIB,
        gmm_tiles=((_SMALL_GROUPS, (256, 1024, 1024)), (_INF, (512, 1024, 1024))),
        tgmm_tiles=((_INF, (512, 1024, 512)),), mxu_side=256),
}

_DEVICE_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                 "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "tpu7x"}
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("pallas_target", default=None)


@contextlib.contextmanager
def use_target(name: str):
  """Compile the kernels for generation `name` (e.g. AOT-lowering for "v5p" on a CPU host).

  Trace under the context: jit caches do not see it, so lower a fresh jit(...) inside it.
  """
  token = _TARGET.set(get_generation(name).name)
  try:
    yield
  finally:
    _TARGET.reset(token)


def get_generation(target: str | Generation | None = None) -> Generation:
  """Explicit target, else use_target's, else the default device's kind ("cpu" if not a TPU)."""
  if isinstance(target, Generation):
    return target
  target = target or _TARGET.get()
  if target is None:
    if jax.default_backend() != "tpu":
      return GENERATIONS["cpu"]
    kind = jax.devices()[0].device_kind
    if kind not in _DEVICE_KINDS:
      raise ValueError(f"no tuning entry for TPU device kind {kind!r}")
    target = _DEVICE_KINDS[kind]
  if target not in GENERATIONS:
    raise ValueError(f"unknown target {target!r}; expected one of {sorted(GENERATIONS)}")
  return GENERATIONS[target]


def mxu_dtype(gen: Generation, fmt: str):
  """The dtype fed to the MXU: the stored element type where native and the format has no block
  scales (a row scale factors out of the K-sum; block scales do not), else bfloat16."""
  f = quant.get_format(fmt)
  if f.block is None and f.values_dtype.name in gen.native_mxu_dtypes:
    return f.values_dtype
  return quant.FORMATS["bf16"].values_dtype


def fp4_packed(gen: Generation, fmt: str) -> bool:
  """Whether NVFP4 values travel as two 4-bit codes per uint8 (Mosaic cannot hold f4 here)."""
  return quant.get_format(fmt).name == "nvfp4" and not gen.fp4_in_vmem


def round_up(x: int, m: int) -> int:
  """Smallest positive multiple of m that is >= x (one tile even for an empty dimension)."""
  return max(-(-x // m), 1) * m


def vmem_bytes(kind: str, tiles: tuple[int, int, int], fmt: str, out_itemsize: int) -> int:
  """Estimated VMEM for one kernel instance: double-buffered input/output tiles, the f32
  accumulator, and the dequantisation temporaries (f32 + bf16 copies of each operand tile)."""
  tm, tk, tn = tiles
  f = quant.get_format(fmt)
  elem = f.values_dtype.itemsize if f.name != "nvfp4" else 0.5
  if kind == "gmm":
    in_tiles, acc, temp_tiles = tm * tk + tk * tn, tm * tn, tm * tk + tk * tn
  else:
    in_tiles, acc, temp_tiles = tm * tk + tm * tn, tk * tn, tm * tk + tm * tn
  scales = 0 if f.block is None else 2 * in_tiles // f.block * 4 * 4  # lane-padding slack
  temps = 0 if f.name == "bf16" else temp_tiles * (4 + 2 + (4 if kind == "tgmm" else 0))
  return int(2 * in_tiles * elem + scales + 2 * acc * out_itemsize + acc * 4 + temps)


def select_tiles(kind: str, gen: Generation, m: int, k: int, n: int, num_groups: int, fmt: str,
                 out_itemsize: int = 4) -> tuple[int, int, int]:
  """(tm, tk, tn) for an [M,K]x[G,K,N] problem (kind "gmm") or [M,K]^T[M,N] (kind "tgmm").

  Table row by rows-per-group, clipped to the (aligned) problem, then halved (tn, then tk) until
  the VMEM estimate fits the generation's limit. All tiles are multiples of 128; the gmm tk is a
  multiple of 256 when NVFP4 travels packed (each half of the tile must be lane aligned).
  """
  rows_per_group = m / max(num_groups, 1)
  table = gen.gmm_tiles if kind == "gmm" else gen.tgmm_tiles
  tm, tk, tn = next(t for limit, t in table if rows_per_group <= limit)
  k_align = 2 * ALIGN if (kind == "gmm" and fp4_packed(gen, fmt)) else ALIGN
  tm = min(tm, round_up(m, ALIGN))
  tk = round_up(min(tk, round_up(k, k_align)), k_align)
  tn = min(tn, round_up(n, ALIGN))
  while vmem_bytes(kind, (tm, tk, tn), fmt, out_itemsize) > gen.vmem_limit_bytes:
    if tn > ALIGN:
      tn = round_up(tn // 2, ALIGN)
    elif tk > k_align:
      tk = round_up(tk // 2, k_align)
    else:
      break
  return tm, tk, tn
