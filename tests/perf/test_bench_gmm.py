"""c2.bench gmm: the shape and group-size helpers, the dispatcher, and the error checks that
make the benchmark fail when a kernel disagrees with its reference (the full benchmark is run by
hand, see c2/perf/bench_gmm.py)."""
import numpy as np
import pallas_kernels

from c2 import bench
from c2.perf import bench_gmm


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


def test_error_tables_pass_on_the_kernel_and_fail_on_a_wrong_one(monkeypatch):
  """bf16 on the small shape: within tolerance as shipped; a kernel 1% off fails both tables
  (forward vs the specification, gradients vs float32), so main() would exit 1."""
  assert bench_gmm.error_table(["small"], ["bf16"]) == []
  assert bench_gmm.gradient_table("small", ["bf16"]) == []
  right = pallas_kernels.gmm
  monkeypatch.setattr(pallas_kernels, "gmm", lambda *a, **k: 1.01 * right(*a, **k))
  forward = bench_gmm.error_table(["small"], ["bf16"])
  assert forward and "vs spec" in forward[0]
  backward = bench_gmm.gradient_table("small", ["bf16"])
  assert backward and "mean_rel" in backward[0]
