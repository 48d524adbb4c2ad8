"""Progress of checkpoint import/export on stderr: bytes done of total, bytes/s and ETA.

A thin wrapper over tqdm (already a core dependency) counting bytes, so the rate reads in MB/s
and GB/s and the ETA of a 595 GB import is visible from the first leaf; disabled it costs nothing.
"""
from __future__ import annotations


def progress_bar(enabled: bool, total_bytes: int, desc: str):
  """An object with update(n_bytes) and close()."""
  if not enabled:
    return _NoBar()
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
              mininterval=1.0, smoothing=0.1)


class _NoBar:
  def update(self, n: int) -> None:
    del n

  def close(self) -> None:
    pass
