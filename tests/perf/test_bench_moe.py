"""c2.bench moe: runs, checks its paths against each other, reports ratios, and fails on a
path that disagrees."""
from c2 import bench
from c2.perf import bench_moe

ARGS = ["moe", "--tokens", "64", "--repeats", "1", "--skip", "pallas_bf16"]


def test_moe_bench_lists_paths_with_ratios(capsys):
  assert "moe" in bench.available()
  assert bench.main(ARGS) == 0
  out = capsys.readouterr().out
  for name in ("all_experts", "every_expert", "ragged_dot", "dense_gmm"):
    assert name in out
  assert "x fastest" in out and "FAIL" not in out


def test_a_wrong_path_fails_the_bench(monkeypatch, capsys):
  """A path 3% off (a wrong scale, as a bad combine weight would give) exits 1 and is named."""
  right = bench_moe.paths()
  wrong = dict(right, ragged_dot=lambda *a: 1.03 * right["ragged_dot"](*a))
  monkeypatch.setattr(bench_moe, "paths", lambda: wrong)
  assert bench.main(ARGS) == 1
  out = capsys.readouterr().out
  assert "FAILED: ragged_dot" in out
