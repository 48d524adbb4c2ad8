"""pass@k: the chance that at least one of k samples of a task passes, estimated from n >= k.

The unbiased estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
with n samples of a task of which c pass,

    pass@k = 1 - C(n - c, k) / C(n, k)

is the probability that a k-subset drawn without replacement from the n samples holds a passing
one, i.e. the mean over all C(n, k) subsets, so its expectation is the true pass@k. Taking
1 - (1 - c/n)^k instead is biased low. The binomials overflow floats for large n (C(200, 100) is
~1e58), so the ratio is computed as the product prod_{i=n-c+1}^{n} (1 - k / i), which is exact in
exact arithmetic and stays in [0, 1] in floating point.

Composer 2 reports "best-of-K" beside average reward on held-out tasks (report section 4.10);
this is that number, averaged over tasks.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one task with n samples, c of them passing (0 <= c <= n, 1 <= k <= n)."""
  if not 0 <= c <= n:
    raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
  if not 1 <= k <= n:
    raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}: pass@k needs at least k samples")
  if n - c < k:  # every k-subset holds a passing sample
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_over_tasks(counts: Iterable[tuple[int, int]], ks: Sequence[int]) -> dict[int, float]:
  """Mean pass@k over tasks, for each k in ks. counts: (n, c) per task; every task needs n >= k."""
  counts = list(counts)
  if not counts:
    return {}
  return {k: float(np.mean([pass_at_k(n, c, k) for n, c in counts])) for k in ks}
