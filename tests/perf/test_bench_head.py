"""c2.bench head: the loss head over every token and over the weighted ones agree, the bench
reports both objectives' ratio, and a head setting that changes the loss fails it."""
import numpy as np
import pytest

from c2 import bench
from c2.losses import lm as lm_lib
from c2.perf import bench_head

ARGS = ["head", "--rows", "2", "--seq-len", "64", "--span", "8", "--chunk", "16", "--repeats", "1",
        "--layers", "2"]  # a dense layer and an MoE layer: compiles faster


def test_synthetic_batch_weighs_the_asked_share_in_closing_spans():
  batch = bench_head.synthetic_batch(3, 960, 0.25, 8, 50)
  mask, segments = np.asarray(batch["loss_mask"]), np.asarray(batch["segment_ids"])
  assert abs(mask.mean() - 0.25) < 0.02  # a row's cut first segment may be all span
  for row in range(3):  # each weighted span ends its segment
    ends = np.flatnonzero(np.diff(segments[row]) != 0)
    assert all(mask[row, e] == 1 for e in ends)


@pytest.mark.slow  # ~53 s on 2 cores; the default suite keeps under 15 minutes
def test_bench_reports_both_objectives_and_fails_the_one_whose_settings_disagree(monkeypatch,
                                                                                 capsys):
  """One run (four compiles): the LM loss is made 0.1% off when it skips unweighted tokens, so
  its row fails and the exit status is 1; the RL row agrees and passes."""
  assert "head" in bench.available()
  real = lm_lib.lm_loss

  def skewed(cfg, params, batch, weights, *args):
    loss, aux = real(cfg, params, batch, weights, *args)
    return (loss * 1.001 if weights.ce_weighted_only else loss), aux

  monkeypatch.setattr(lm_lib, "lm_loss", skewed)
  assert bench.main(ARGS) == 1
  rows = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
  assert rows["sft (lm loss)"].endswith("FAIL")
  assert "x" in rows["rl (policy gradient)"] and "FAIL" not in rows["rl (policy gradient)"]
  assert any(line.startswith("FAILED: sft (lm loss):") for line in rows)
