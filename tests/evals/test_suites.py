"""Suite names, a real suite on the small model, and the results file and table."""
import json

import pytest

from c2.evals import codebase_loss, report, suites
from c2.evals.probe_model import ProbeModel


def test_parse_suites():
  assert suites.parse_suites("base") == ["codebase", "state_tracking", "knowledge"]
  assert suites.parse_suites("knowledge, codebase,base") == ["knowledge", "codebase",
                                                            "state_tracking"]
  assert suites.parse_suites("all") == list(suites.SUITES)
  with pytest.raises(ValueError, match="unknown eval suite 'codebse'"):
    suites.parse_suites("codebse")


def test_codebase_suite_on_the_small_model(small_model, tokenizer):
  cfg, params = small_model
  options = suites.SuiteOptions(context=32, codebase_bytes=1200, batch=4)
  out = suites.run_suites(["codebase"], cfg, params, tokenizer, options)
  assert out["eval/codebase/bytes"] == 1200
  # A random-init model is near uniform: about ln(vocab) = 6.24 nats per token.
  assert 5.5 < out["eval/codebase/nats_per_token"] < 7.5
  assert out["eval/codebase/nats_per_byte"] == pytest.approx(out["eval/codebase/nats"] / 1200)
  # A text within one window: the rolling total is the plain sum of the row's log-probs.
  probe = ProbeModel(cfg, params, tokenizer, context=32, batch=4)
  text = codebase_loss.stdlib_text(max_bytes=40)
  ids = tokenizer.encode(text)
  assert len(ids) < 32
  [logp] = probe.logprobs([[tokenizer.bos_id] + ids])
  rolled = codebase_loss.codebase_loss(text, tokenizer.encode, probe.logprobs, window=32,
                                       stride=16, bos_id=tokenizer.bos_id)
  assert rolled["nats"] == pytest.approx(-logp.sum(), rel=1e-6)


def test_results_merge_and_table(tmp_path):
  report.record(str(tmp_path), "b", 240, {"eval/x/pass_at_10": 0.5, "eval/x/pass_at_2": 0.25})
  report.record(str(tmp_path), "a", 60, {"eval/x/pass_at_2": 0.125})
  results = report.record(str(tmp_path), "b", 240, {"eval/x/y": 3.0})
  assert list(results) == ["a", "b"]  # by step
  assert results["b"] == {"eval/x/pass_at_10": 0.5, "eval/x/pass_at_2": 0.25, "eval/x/y": 3.0}
  stored = json.loads((tmp_path / report.RESULTS_FILE).read_text())
  assert stored["a"]["step"] == 60
  lines = report.format_table(results).splitlines()
  assert [l.split()[0] for l in lines[1:]] == ["eval/x/pass_at_2", "eval/x/pass_at_10", "eval/x/y"]
  assert lines[1].split()[1:] == ["0.125", "0.25"] and lines[3].split()[1:] == ["-", "3"]
