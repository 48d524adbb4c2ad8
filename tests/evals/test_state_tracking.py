"""State tracking: the edit distance, the examples (diff chains that really lead to the target),
and the scores of an oracle, a copier and a babbler."""
import random
import re

import pytest

from c2.evals import state_tracking as st
from tests.evals.conftest import ScriptedProbe


def _levenshtein(a, b):
  d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
  for i in range(1, len(a) + 1):
    for j in range(1, len(b) + 1):
      d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
  return d[-1][-1]


def test_edit_distance_matches_textbook_dp():
  rng = random.Random(0)
  for _ in range(300):
    a = "".join(rng.choice("abcé ") for _ in range(rng.randrange(12)))
    b = "".join(rng.choice("abcé ") for _ in range(rng.randrange(12)))
    assert st.edit_distance(a, b) == _levenshtein(a, b), (a, b)
  assert st.edit_distance("kitten", "sitting") == 3


def _apply_hunks(lines, diff):
  """Applies a headerless unified diff (context 1) to lines; asserts the context matches."""
  out, cursor = [], 0
  hunks = re.split(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@$", diff, flags=re.M)[1:]
  for start, count, body in zip(hunks[0::3], hunks[1::3], hunks[2::3]):
    start = int(start) - (0 if count == "0" else 1)
    out += lines[cursor:start]
    cursor = start
    for line in body.strip("\n").split("\n"):
      if line.startswith((" ", "-")):
        assert lines[cursor] == line[1:]
        cursor += 1
      if line.startswith((" ", "+")):
        out.append(line[1:])
  return out + lines[cursor:]


def test_examples_are_deterministic_and_their_diffs_lead_to_the_target():
  examples = st.build_examples(12, num_lines=5, num_diffs=3, seed=1)
  assert len(examples) == 12 and examples == st.build_examples(12, num_lines=5, num_diffs=3, seed=1)
  assert examples != st.build_examples(12, num_lines=5, num_diffs=3, seed=2)
  for ex in examples:
    sections = re.split(r"^### .*$\n?", ex.prompt, flags=re.M)
    original, diffs = sections[1], sections[2:-1]
    assert original == ex.original and len(diffs) == 3
    lines = original.rstrip("\n").split("\n")
    for diff in diffs:
      lines = _apply_hunks(lines, diff)
    assert "\n".join(lines) + "\n" == ex.target
    assert ex.prompt.endswith("### after 3 diffs\n")


def test_scores_of_oracle_copier_and_babbler(tokenizer):
  examples = st.build_examples(6, num_lines=4, num_diffs=2)
  by_prompt = {ex.prompt: ex for ex in examples}
  oracle = ScriptedProbe(tokenizer, lambda p: by_prompt[p].target + "### done\nmore", context=512)
  out = st.evaluate(oracle, examples)
  assert out["char_distance"] == 0 and out["exact_match"] == 1 and out["examples"] == 6
  copier = ScriptedProbe(tokenizer, lambda p: by_prompt[p].original, context=512)
  out = st.evaluate(copier, examples)
  assert out["char_distance"] == pytest.approx(out["copy_baseline_distance"])
  assert out["char_distance"] > 0
  assert out["exact_match"] == 0
  babbler = ScriptedProbe(tokenizer, lambda p: "x" * 300, context=512)
  assert st.evaluate(babbler, examples)["char_distance"] > out["char_distance"]
  # Examples that do not fit the context are skipped and counted, never truncated.
  small = st.evaluate(ScriptedProbe(tokenizer, lambda p: "", context=64), examples)
  assert small == {"skipped": 6.0}
