"""c2.bench envs at toy sizes: every (mode, N) is measured, every oracle rollout scores 1.0, the
figures are sane and the ratios are the quotients of the measured figures (speeds themselves are
not asserted: noisy on a shared 2-core machine)."""
import json

import pytest

from c2.envs import sandbox
from c2.envs.policies import NoopPolicy
from c2.perf import bench_envs


def _modes() -> list[str]:
  return ["none", "rlimits"] + (["bwrap"] if sandbox.bwrap_problem() is None else [])


def test_bench_reports_sane_figures_and_ratios(tmp_path, capsys):
  out = tmp_path / "envs.json"
  modes = _modes()
  rc = bench_envs.main(["--concurrency", "1,2", "--rollouts", "3", "--modes", ",".join(modes),
                        "--json", str(out)])
  printed = capsys.readouterr().out
  assert rc == 0, printed
  figures = json.loads(out.read_text())
  assert figures["failures"] == []
  results = {(r["mode"], r["concurrency"]): r for r in figures["results"]}
  assert set(results) == {(m, n) for m in modes for n in (1, 2)}
  for (mode, n), r in results.items():
    assert r["completed"] == r["rollouts"] == max(3, 2 * n)
    assert r["min_task_reward"] == 1.0
    assert r["rollouts_per_s"] > 0 and r["seconds"] > 0
    assert r["grade_count"] == r["rollouts"]  # one grading per rollout
    # every call counted: file tools, run, and at least one finish per rollout
    assert r["call_count"] >= r["file_count"] + r["run_count"] + r["rollouts"]
    for kind in ("call", "file", "grade"):
      assert 0 < r[f"{kind}_p50_ms"] <= r[f"{kind}_p99_ms"], (mode, n, kind)
    # The pool's first task without a visible test command: a 3-rollout N=1 run may have no `run`.
    assert (r["run_p50_ms"] is None) == (r["run_count"] == 0)
    assert f"{mode:<8}{n:>4}" in printed
  assert len(figures["ratios"]) == (len(modes) - 1) * 2
  for row in figures["ratios"]:
    sandboxed, none = results[row["mode"], row["concurrency"]], results["none", row["concurrency"]]
    assert row["mode"] != "none"
    for key in bench_envs.RATIO_KEYS:
      if sandboxed[key] is None:
        assert row[key] is None
      else:
        assert row[key] == pytest.approx(sandboxed[key] / none[key])
  assert "sandboxed / none" in printed


def test_bench_fails_when_a_rollout_does_not_score_one(tmp_path, monkeypatch, capsys):
  # A policy that finishes at once scores 0: the bench must say so and exit 1, not report speed.
  monkeypatch.setattr(bench_envs, "OraclePolicy", lambda task: NoopPolicy())
  out = tmp_path / "envs.json"
  rc = bench_envs.main(["--concurrency", "1", "--rollouts", "1", "--modes", "none",
                        "--json", str(out)])
  assert rc == 1
  assert "did not score 1.0" in capsys.readouterr().out
  assert json.loads(out.read_text())["failures"]
