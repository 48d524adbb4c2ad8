"""The MoE bench runs, checks its paths against each other, and reports ratios."""
from c2 import bench


def test_moe_bench_lists_paths_with_ratios(capsys):
  assert "moe" in bench.available()
  assert bench.main(["moe", "--tokens", "64", "--repeats", "1", "--skip", "pallas_bf16"]) == 0
  out = capsys.readouterr().out
  for name in ("all_experts", "ragged_dot", "dense_gmm"):
    assert name in out
  assert "x fastest" in out
