"""Accelerator facts the reports need: peak dense bf16 FLOP/s and HBM per device.

Per *device* as JAX sees it (v4/v5p megacore: one device per chip; TPU7x: two devices per chip).
Public spec-sheet numbers; CPU has no spec, so its peak is measured once with a matmul.
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ChipSpec:
  name: str
  peak_bf16_flops: float  # per device
  hbm_bytes: int  # per device


GiB = 1 << 30
CHIPS = {
    "v4": ChipSpec("TPU v4", 275e12, 32 * GiB),
    "v5e": ChipSpec("TPU v5 lite", 197e12, 16 * GiB),
    "v5p": ChipSpec("TPU v5", 459e12, 95 * GiB),
    "v6e": ChipSpec("TPU v6 lite", 918e12, 32 * GiB),
    # TPU7x (Ironwood): 4.6 PFLOP/s fp8 and 192 GB per chip, exposed as 2 devices.
    "tpu7x": ChipSpec("TPU7x", 2307e12 / 2, 96 * GiB),
}
_KIND_TO_CHIP = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
                 "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "tpu7x"}


# Accelerator-type names (`gcloud compute tpus ... --accelerator-type`, xpk --tpu-type) count
# TensorCores for v4, v5p and tpu7x (two per chip) and chips for v5e and v6e. Their default
# slice shapes grow by doubling the last of the smallest dimensions: 2x2x1, 2x2x2, 2x2x4, 2x4x4,
# 4x4x4, 4x4x8, ... (v5p-256 is 128 chips, 4x4x8; tpu7x-256 is 4x4x8 too) and 2x2, 2x4, 4x4, ...
_ACCELERATOR_TYPES = {  # name prefix -> (generation, cores counted per chip, dimensions)
    "v4": ("v4", 2, 3), "v5p": ("v5p", 2, 3), "tpu7x": ("tpu7x", 2, 3),
    "v5litepod": ("v5e", 1, 2), "v5e": ("v5e", 1, 2), "v6e": ("v6e", 1, 2),
}


def resolve_topology(name: str) -> str:
  """'v5p:4x4x8' as it is; an accelerator type such as 'v5p-256', 'v6e-64' or 'tpu7x-128' ->
  its default topology ('v5p:4x4x8', 'v6e:8x8', 'tpu7x:4x4x4')."""
  if ":" in name:
    chip_of_topology(name)
    return name
  prefix, _, count = name.lower().rpartition("-")
  if prefix not in _ACCELERATOR_TYPES or not count.isdigit():
    raise ValueError(f"unknown TPU topology or accelerator type {name!r}; give a topology such "
                     f"as v5p:4x4x8 or an accelerator type such as v5p-256, v6e-64, tpu7x-128")
  generation, per_chip, ndim = _ACCELERATOR_TYPES[prefix]
  chips = int(count) // per_chip
  shape = [2, 2, 1][:ndim] if ndim == 3 else [1, 1]
  while math.prod(shape) < chips:
    smallest = min(shape)
    shape[len(shape) - 1 - shape[::-1].index(smallest)] *= 2
  if math.prod(shape) != chips or int(count) % per_chip:
    raise ValueError(f"accelerator type {name!r} has no default slice shape here ({chips} chips "
                     f"is not a power of two); give the topology, e.g. {generation}:4x4x6")
  return f"{generation}:" + "x".join(map(str, shape))


def chip_of_topology(topology: str) -> ChipSpec:
  """'v5p:16x16x16' -> the v5p spec."""
  name = topology.split(":")[0].lower()
  if name not in CHIPS:
    raise ValueError(f"unknown TPU generation {name!r} in topology {topology!r}; "
                     f"choose one of {sorted(CHIPS)} (e.g. v5p:4x4x4, tpu7x:2x2x1)")
  return CHIPS[name]


def chip_of_device(device: jax.Device) -> ChipSpec | None:
  key = _KIND_TO_CHIP.get(device.device_kind)
  return CHIPS[key] if key else None


_measured_peak: dict[str, float] = {}


def peak_flops_per_device(device: jax.Device | None = None) -> tuple[float, str]:
  """(FLOP/s, source): the spec sheet for known accelerators, else a measured f32 matmul rate."""
  device = device or jax.devices()[0]
  spec = chip_of_device(device)
  if spec is not None:
    return spec.peak_bf16_flops, "spec"
  if device.platform not in _measured_peak:
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
      out = mm(a)
    out.block_until_ready()
    _measured_peak[device.platform] = 2 * n ** 3 * reps / (time.perf_counter() - start)
  return _measured_peak[device.platform], "measured matmul"
