"""Accelerator facts the reports need: peak dense bf16 FLOP/s and HBM per device.

Per *device* as JAX sees it (v4/v5p megacore: one device per chip; TPU7x: two devices per chip).
Public spec-sheet numbers; CPU has no spec, so its peak is measured once with a matmul.
"""
from __future__ import annotations

import dataclasses
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
