"""The knowledge probe's file format, its builtin pairs, and exact-match scoring."""
import json

import pytest

from c2.evals import knowledge
from tests.evals.conftest import ScriptedProbe


def test_read_pairs_and_errors_name_the_line(tmp_path):
  path = tmp_path / "qa.jsonl"
  path.write_text(json.dumps({"question": "2 + 2?", "answer": " 4 "}) + "\n\n" +
                  json.dumps({"question": "q", "answer": "a", "source": "x"}) + "\n")
  assert knowledge.read_pairs(str(path)) == [{"question": "2 + 2?", "answer": "4"},
                                             {"question": "q", "answer": "a"}]
  path.write_text(json.dumps({"question": "q"}) + "\n")
  with pytest.raises(ValueError, match="qa.jsonl:1"):
    knowledge.read_pairs(str(path))
  path.write_text("{not json\n")
  with pytest.raises(ValueError, match="qa.jsonl:1: not JSON"):
    knowledge.read_pairs(str(path))


def test_builtin_pairs_are_deterministic_and_true():
  pairs = knowledge.builtin_pairs(20, seed=3)
  assert pairs == knowledge.builtin_pairs(20, seed=3) and len(pairs) == 20
  assert len({p["question"] for p in pairs}) == 20
  import importlib
  for p in pairs[:8]:  # the answer module really defines the function
    name = p["question"].split("`")[1]
    try:
      module = importlib.import_module(p["answer"])
    except Exception:  # pylint: disable=broad-except  (e.g. modules needing a display)
      continue
    assert hasattr(module, name), p


def test_exact_match_and_answer_nats(tokenizer):
  pairs = [{"question": f"q{i}", "answer": f"mod{i}.sub"} for i in range(4)]
  answers = {knowledge.PROMPT.format(question=p["question"]): p["answer"] for p in pairs}
  right = ScriptedProbe(tokenizer, lambda p: answers[p] + "\n# Q: next", logp=-0.5)
  out = knowledge.evaluate(right, pairs)
  assert out["exact_match"] == 1.0 and out["questions"] == 4
  answer_tokens = sum(len(tokenizer.encode(p["answer"])) for p in pairs)
  answer_bytes = sum(len(p["answer"]) for p in pairs)
  assert out["answer_nats_per_byte"] == pytest.approx(0.5 * answer_tokens / answer_bytes)
  half = ScriptedProbe(tokenizer, lambda p: answers[p] + ("" if p.endswith("q1\n# A: ") or
                                                          p.endswith("q2\n# A: ") else "x"))
  assert knowledge.evaluate(half, pairs)["exact_match"] == 0.5
