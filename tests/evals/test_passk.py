"""The unbiased pass@k estimator against brute-force enumeration of every k-subset."""
import itertools
import math

import pytest

from c2.evals import passk


def _brute_force(n: int, c: int, k: int) -> float:
  outcomes = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_equals_enumeration_of_all_subsets(n):
  worst = 0.0
  for c in range(n + 1):
    for k in range(1, n + 1):
      worst = max(worst, abs(passk.pass_at_k(n, c, k) - _brute_force(n, c, k)))
  assert worst < 1e-12


def test_closed_form_and_edges():
  assert passk.pass_at_k(10, 0, 5) == 0.0
  assert passk.pass_at_k(10, 6, 5) == 1.0  # n - c < k
  assert passk.pass_at_k(10, 3, 1) == pytest.approx(0.3)
  assert passk.pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
  # Large n: the binomials overflow floats, the product form does not.
  exact = 1 - math.comb(400 - 7, 150) / math.comb(400, 150)
  assert passk.pass_at_k(400, 7, 150) == pytest.approx(exact, rel=1e-12)
  # Biased estimator 1 - (1 - c/n)^k is lower; the unbiased one must not equal it.
  assert passk.pass_at_k(4, 1, 2) == pytest.approx(0.5)
  assert 1 - (1 - 1 / 4) ** 2 == pytest.approx(0.4375)


def test_mean_over_tasks_and_errors():
  curve = passk.pass_at_k_over_tasks([(4, 0), (4, 1), (4, 4)], ks=[1, 2, 4])
  assert curve[1] == pytest.approx((0 + 0.25 + 1) / 3)
  assert curve[2] == pytest.approx((0 + 0.5 + 1) / 3)
  assert curve[4] == pytest.approx((0 + 1 + 1) / 3)
  with pytest.raises(ValueError, match="at least k"):
    passk.pass_at_k(3, 1, 4)
  with pytest.raises(ValueError):
    passk.pass_at_k(3, 4, 1)
