"""c2.bench gmm: the shape and group-size helpers, and the dispatcher (no compiles here; the
benchmark itself is run by hand, see c2/bench_gmm.py)."""
import numpy as np

from c2 import bench, bench_gmm


def test_ragged_sizes_fit_and_include_an_empty_group():
  for name, shape in bench_gmm.SHAPES.items():
    sizes = bench_gmm.ragged_sizes(shape)
    assert sizes.shape == (shape.g,) and sizes.dtype == np.int32, name
    assert 0.9 * shape.m <= sizes.sum() <= shape.m, name
    assert shape.g == 1 or sizes[1] == 0, name


def test_kimi_shapes_are_the_per_device_expert_shapes():
  up, down = bench_gmm.SHAPES["kimi_up"], bench_gmm.SHAPES["kimi_down"]
  assert (up.k, up.n, down.k, down.n) == (7168, 2 * 2048, 2048, 7168)  # D, 2F / F, D
  assert up.g == down.g == 384 // 8 and up.m == 4096 * 8  # EP=8; 4,096 tokens x top-8


def test_dispatcher_lists_gmm(capsys):
  assert bench.main([]) == 0 and "gmm" in capsys.readouterr().out
  assert bench.main(["no-such-bench"]) == 2
