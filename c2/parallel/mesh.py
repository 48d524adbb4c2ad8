"""Device meshes with axes named by role.

Axes, outermost (slowest interconnect) first:
  data     pure data parallelism (replicated params; across slices over DCN)
  fsdp     data parallelism with parameters and optimizer state sharded (ZeRO-3)
  expert   expert parallelism: routed experts split across it; tokens are also split over it
  tensor   tensor (model) parallelism inside heads / FFN columns
  context  sequence (context) parallelism for long sequences

Model code never names these axes: it uses logical names mapped by `c2.parallel.sharding.RULES`.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "expert", "tensor", "context")


def resolve_axis_sizes(axis_sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Fills in one -1 so that the product of sizes equals `num_devices`; validates names."""
  unknown = set(axis_sizes) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; mesh axes are {MESH_AXES}")
  sizes = {name: int(axis_sizes.get(name, 1)) for name in MESH_AXES}
  wildcards = [name for name, size in sizes.items() if size == -1]
  if len(wildcards) > 1:
    raise ValueError(f"mesh: at most one axis may be -1, got {wildcards}")
  known = math.prod(size for size in sizes.values() if size != -1)
  if any(size == 0 or size < -1 for size in sizes.values()):
    raise ValueError(f"mesh: axis sizes must be positive or -1, got {sizes}")
  if wildcards:
    if num_devices % known:
      raise ValueError(f"mesh: {num_devices} devices are not divisible by the fixed axes {sizes}")
    sizes[wildcards[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(
        f"mesh: axis sizes {sizes} multiply to {math.prod(sizes.values())}, but there are "
        f"{num_devices} devices; set one axis to -1 or fix the sizes")
  return sizes


def make_mesh(axis_sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None,
              num_slices: int = 1) -> Mesh:
  """Builds a mesh with all five role axes (size-1 axes included) and Auto axis types.

  Auto axes keep GSPMD propagation: model code states logical constraints and the compiler fills
  in the rest (jax 0.10 defaults to Explicit axes, which would turn constraints into asserts).
  With `num_slices > 1` the `data` axis spans slices (DCN), everything else stays inside a slice.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_axis_sizes(axis_sizes, len(devices))
  shape = tuple(sizes[name] for name in MESH_AXES)
  if num_slices > 1:
    if sizes["data"] % num_slices:
      raise ValueError(f"mesh: data={sizes['data']} must be a multiple of num_slices={num_slices}")
    from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
    ici = (sizes["data"] // num_slices,) + shape[1:]
    dcn = (num_slices,) + (1,) * (len(shape) - 1)
    device_array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices,
                                                        allow_split_physical_axes=True)
  elif devices[0].platform == "tpu":
    from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
    device_array = mesh_utils.create_device_mesh(shape, devices=devices,
                                                 allow_split_physical_axes=True)
  else:
    device_array = np.asarray(devices).reshape(shape)
  return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def target_platform() -> str:
  """'tpu', 'gpu' or 'cpu': the platform of the active mesh's devices, else the default backend.

  "auto" implementation choices use this rather than jax.default_backend(), so an AOT compile
  for a TPU topology from a CPU host picks the TPU paths.
  """
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh is None or mesh.empty else getattr(mesh, "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()
