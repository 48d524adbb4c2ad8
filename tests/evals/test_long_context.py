"""Long-context suites: position buckets, retrieval prompts of the asked length holding their
facts, and scoring."""
import re

import numpy as np
import pytest

from c2.evals import codebase_loss, long_context
from tests.evals.conftest import ScriptedProbe


def test_position_buckets_cover_every_scored_position():
  assert long_context.position_buckets(10) == [(1, 2), (2, 4), (4, 8), (8, 10)]
  covered = [p for lo, hi in long_context.position_buckets(300) for p in range(lo, hi)]
  assert covered == list(range(1, 300))


@pytest.mark.parametrize("kind", ["needle", "variables"])
def test_retrieval_prompts_fit_and_hold_the_answer(tokenizer, kind):
  filler = long_context._filler_lines(codebase_loss.stdlib_text(max_bytes=50_000))
  for length in (64, 256):
    pairs = long_context.build_retrieval(kind, tokenizer, filler, length, 6, seed=0)
    for prompt, answer in pairs:
      total = 1 + len(tokenizer.encode(prompt)) + len(tokenizer.encode(answer))
      assert length // 2 < total <= length, (length, total)
      if kind == "needle":
        assert f"PASSKEY = {answer}\n" in prompt and prompt.endswith("assert PASSKEY == ")
      else:
        first, second = re.findall(r"^(var_\w+) = (\S+)$", prompt, re.M)
        assert first[1] == answer and second[1] == first[0]
        assert prompt.index(first[0] + " =") < prompt.index(second[0] + " =")
        assert prompt.endswith(f"assert {second[0]} == ")
    assert len({a for _, a in pairs}) > 1  # seeded, different values


def test_scores_and_loss_by_position(tokenizer):
  def oracle(prompt):
    return re.search(r"PASSKEY = (\d+)", prompt).group(1) + ")\n"
  probe = ScriptedProbe(tokenizer, oracle, context=128, capacity=300, logp=-2.0)
  filler = long_context._filler_lines(codebase_loss.stdlib_text(max_bytes=50_000))
  pairs = long_context.build_retrieval("needle", tokenizer, filler, 128, 4, seed=0)
  out = long_context.retrieval_scores(probe, pairs, 128)
  assert out["accuracy"] == 1.0
  assert out["answer_nats"] == pytest.approx(2.0 * np.mean([len(tokenizer.encode(a))
                                                            for _, a in pairs]))
  wrong = ScriptedProbe(tokenizer, lambda p: "12", context=128, capacity=300)
  assert long_context.retrieval_scores(wrong, pairs, 128)["accuracy"] == 0.0
  curve = long_context.loss_by_position(probe, list(range(10, 500)), 64, rows=3)
  assert curve.pop("position_rows") == 3
  assert set(curve) == {f"nll_pos{lo}" for lo, _ in long_context.position_buckets(64)}
  assert all(v == pytest.approx(2.0) for v in curve.values())
  assert long_context.loss_by_position(probe, list(range(100)), 128, rows=2) == {
      "position_rows": 0.0}  # too little text for one row: said, not faked
