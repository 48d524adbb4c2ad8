"""The sharding report: every array's shape, dtype, spec and bytes per device, and a check that
fails when too much of the model stays replicated. Printed by process 0 at start-up.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding


@dataclasses.dataclass(frozen=True)
class ShardingRow:
  name: str
  shape: tuple[int, ...]
  dtype: str
  spec: str
  bytes_total: int
  bytes_per_device: int


def report(abstract_tree: Any, shardings: Any) -> list[ShardingRow]:
  """One row per array: path, shape, dtype, spec and bytes per device."""
  rows = []
  flat, _ = jax.tree_util.tree_flatten_with_path(abstract_tree)
  flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  for (path, leaf), sharding in zip(flat, flat_shardings):
    total = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    shard_shape = sharding.shard_shape(leaf.shape)
    per_device = int(np.prod(shard_shape)) * np.dtype(leaf.dtype).itemsize
    rows.append(ShardingRow(jax.tree_util.keystr(path, simple=True, separator="/"),
                            tuple(leaf.shape), str(np.dtype(leaf.dtype)), str(sharding.spec),
                            total, per_device))
  return rows


def format_report(rows: Sequence[ShardingRow], limit: int | None = None) -> str:
  lines = [f"{'name':<58} {'shape':<24} {'dtype':<9} {'spec':<40} {'MiB/dev':>10}"]
  for row in rows[:limit]:
    lines.append(f"{row.name:<58} {str(row.shape):<24} {row.dtype:<9} {row.spec:<40} "
                 f"{row.bytes_per_device / 2**20:>10.2f}")
  total = sum(r.bytes_total for r in rows)
  per_device = sum(r.bytes_per_device for r in rows)
  lines.append(f"total {total / 2**30:.3f} GiB, per device {per_device / 2**30:.3f} GiB "
               f"({len(rows)} arrays)")
  return "\n".join(lines)


def check_replication(rows: Sequence[ShardingRow], num_devices: int, *,
                      max_replicated_fraction: float = 0.05, min_bytes: int = 1 << 20) -> None:
  """Fails when arrays left fully replicated hold more than a fraction of the per-device bytes.

  Small arrays (norm scales, router biases) are expected to be replicated; a big replicated
  weight on a multi-device mesh is nearly always a missing rule or an indivisible dimension.
  """
  if num_devices == 1:
    return
  per_device = sum(r.bytes_per_device for r in rows)
  offenders = [r for r in rows if r.bytes_per_device == r.bytes_total and r.bytes_total >= min_bytes]
  replicated = sum(r.bytes_per_device for r in offenders)
  if per_device and replicated / per_device > max_replicated_fraction:
    names = ", ".join(f"{r.name} {r.shape}" for r in offenders[:8])
    raise ValueError(
        f"{replicated / per_device:.1%} of per-device bytes are fully replicated "
        f"(limit {max_replicated_fraction:.0%}): {names}. Add or fix a rule in c2.parallel.sharding.RULES, "
        "or choose mesh axis sizes that divide these dimensions.")
