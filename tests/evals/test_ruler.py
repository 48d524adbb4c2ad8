"""RULER-style tasks: answers correct by construction (variable chains resolved independently),
prompts of the asked length holding their facts, exact-match rules, and scores of scripted probes
whose values are known."""
import random
import re

import numpy as np
import pytest

from c2.evals import codebase_loss, ruler, suites
from tests.evals.conftest import ScriptedProbe


def _resolve(facts):
  """Variable -> value of a list of `name = rhs` assignments, read in order like Python would."""
  env = {}
  for fact in facts:
    name, rhs = fact.split(" = ")
    env[name] = env[rhs] if rhs in env else rhs
  return env


@pytest.mark.parametrize("seed", range(20))
def test_variable_tracking_answer_is_every_variable_holding_the_value(seed):
  task = ruler.make_task("variable_tracking", random.Random(seed), chains=3, hops=4)
  value = re.search(r"equal to (\d+):$", task.query).group(1)
  env = _resolve(task.facts)
  order = [f.split(" = ")[0] for f in task.facts]
  holders = [n for n in order if env[n] == value]
  assert task.answer == ", ".join(holders) and len(holders) == 5
  assert len(task.facts) == 15 and len(set(order)) == 15
  # The control breaks exactly the asked chain: its variables now hold another value.
  control = _resolve(task.control_facts)
  assert not [n for n in order if control[n] == value]
  assert sum(a != b for a, b in zip(task.facts, task.control_facts)) == 1


@pytest.mark.parametrize("seed", range(10))
def test_needle_answers(seed):
  single = ruler.make_task("niah_single", random.Random(seed))
  assert single.facts == (f"PASSKEY = {single.answer}",) and single.query == "PASSKEY ="
  assert single.control_facts != single.facts
  multi = ruler.make_task("niah_multikey", random.Random(seed), keys=5)
  env = _resolve(multi.facts)
  key = multi.query.removesuffix(" =")
  assert env[key] == multi.answer and len(env) == 5 and len(set(env.values())) == 5
  control = _resolve(multi.control_facts)
  assert control[key] != multi.answer and {k: v for k, v in control.items() if k != key} == {
      k: v for k, v in env.items() if k != key}
  with pytest.raises(ValueError, match="unknown RULER task"):
    ruler.make_task("niah", random.Random(0))


@pytest.mark.parametrize("kind", ruler.TASKS)
def test_rendered_prompts_fit_and_hold_the_facts_in_order(tokenizer, kind):
  filler = [l for l in codebase_loss.stdlib_text(max_bytes=50_000).splitlines() if l.strip()]
  lines = ruler.needle_lines(filler)
  rng = random.Random(0)
  for length in (256, 512):
    task = ruler.make_task(kind, rng, code_lines=lines)
    depth = 0.1 if kind == "niah_code" else None
    prompt, control, answer = ruler.render(task, tokenizer, filler, length, rng, depth)
    assert prompt[0] == tokenizer.bos_id and answer == tokenizer.encode(" " + task.answer)
    assert length // 2 < len(prompt) + len(answer) <= length
    assert len(control) + len(answer) <= length
    text = tokenizer.decode(prompt[1:])
    assert text.endswith("\n" + task.query)
    positions = [text.index(f + "\n") for f in task.facts]
    assert positions == sorted(positions)
    # The control is the same haystack with the control facts.
    swapped = text
    for fact, other in zip(task.facts, task.control_facts):
      swapped = swapped.replace(fact + "\n", other + "\n")
    assert tokenizer.decode(control[1:]) == swapped
  with pytest.raises(ValueError, match="without any haystack"):
    ruler.render(ruler.make_task(kind, rng, code_lines=lines), tokenizer, filler, 12, rng)


def test_code_needles_are_unique_held_out_lines_split_into_query_and_answer():
  filler = [l for l in codebase_loss.stdlib_text().splitlines() if l.strip()]
  lines = ruler.needle_lines(filler)
  stripped = [l.strip() for l in filler]
  assert len(lines) > 400
  for line in lines:
    assert stripped.count(line) == 1 and 40 <= len(line) <= 70 and "0x" not in line
  for seed in range(20):
    task = ruler.make_task("niah_code", random.Random(seed), code_lines=lines)
    (needle,), (other,) = task.facts, task.control_facts
    assert needle in lines and other in lines and other != needle
    assert task.query + " " + task.answer == needle and not other.startswith(task.query + " ")
    assert len(task.query) >= len(needle) // 3 and " " in task.answer
  assert ruler._split_needle("abcdefghijkl mn op") == ("abcdefghijkl", "mn op")
  assert ruler._split_needle("abcdefgh ijklmnopqrstuvwxyz") == ("", "")
  with pytest.raises(ValueError, match="needs code_lines"):
    ruler.make_task("niah_code", random.Random(0))


@pytest.mark.parametrize("length", (128, 512, 2048))
def test_code_needle_sits_at_its_depth_and_only_in_the_prompt(tokenizer, length):
  filler = [l for l in codebase_loss.stdlib_text().splitlines() if l.strip()]
  rng = random.Random(length)
  for _ in range(3):
    task = ruler.make_task("niah_code", rng, code_lines=ruler.needle_lines(filler))
    prompt, control, answer = ruler.render(task, tokenizer, filler, length, rng, depth=0.1)
    assert 0.75 * length < len(prompt) + len(answer) <= length
    text, control_text = tokenizer.decode(prompt[1:]), tokenizer.decode(control[1:])
    needle, other = task.facts[0] + "\n", task.control_facts[0] + "\n"
    assert text.count(needle) == 1 and needle not in control_text
    assert control_text.count(other) == 1 and other not in text
    assert text.endswith("\n" + task.query) and control_text.endswith("\n" + task.query)
    assert answer == tokenizer.encode(" " + task.answer)
    # The needle follows ~10% of the haystack: ~90% of the prompt away from the query (give or
    # take a haystack line: line granularity).
    before = len(tokenizer.encode(text[:text.index(needle)]))
    assert 0.1 * len(prompt) - 40 <= before <= 0.1 * len(prompt) + 40
    assert len(prompt) - before >= 0.9 * len(prompt) - 40


def test_answer_matches():
  assert ruler.answer_matches(" 48213)\n", "48213")
  assert ruler.answer_matches("48213", "48213")
  assert not ruler.answer_matches(" 482130", "48213")
  assert not ruler.answer_matches(" 4821", "48213")
  assert ruler.answer_matches(" VAR_A, VAR_B\n", "VAR_A, VAR_B")
  assert not ruler.answer_matches(" VAR_A, VAR_B, VAR_C", "VAR_A, VAR_B")
  assert not ruler.answer_matches(" VAR_A, VAR_BC", "VAR_A, VAR_B")


class _Reader(ScriptedProbe):
  """Answers from the prompt (a perfect retriever) and gives the answer 1 nat per token when the
  prompt holds it as a fact's value, 3 nats per token when it does not."""

  def answer_nats(self, prompts, answers, length=None):
    out = []
    for p, a in zip(prompts, answers):
      text, answer = self.tokenizer.decode(p), self.tokenizer.decode(a).strip()
      held = f"= {answer.split(',')[0]}\n" in text or f" {answer}\n" in text
      out.append((1.0 if held else 3.0) * len(a))
    return out


def _oracle(prompt: str) -> str:
  query = prompt.splitlines()[-1]
  if query.startswith("# variables equal to"):
    facts = re.findall(r"^(VAR_\w+) = (\w+)$", prompt, re.M)
    env = _resolve([f"{a} = {b}" for a, b in facts])
    value = re.search(r"(\d+):$", query).group(1)
    return " " + ", ".join(n for n, _ in facts if env[n] == value) + "\n"
  if not query.endswith(" ="):  # niah_code: the line that the query begins
    return " " + re.search(rf"^{re.escape(query)} (.*)$", prompt, re.M).group(1) + "\n"
  key = query.removesuffix(" =")
  return " " + re.search(rf"^{key} = (\d+)$", prompt, re.M).group(1) + ")\n"


def test_scores_of_known_probes(tokenizer):
  reader = _Reader(tokenizer, _oracle, context=256, capacity=300)
  out = ruler.evaluate(reader, lengths=(128, 256, 512), examples=3, seed=0)
  assert not any(k.endswith("_len512") for k in out)  # beyond the probe's capacity: skipped
  assert "variable_tracking/accuracy_len128" not in out  # its facts alone need 186 tokens
  assert out["accuracy_len128"] == 1.0
  for length in (256,):
    for kind in ruler.TASKS:
      assert out[f"{kind}/accuracy_len{length}"] == 1.0
    # Needles: the answer's value is in the prompt, not in the control: 3 - 1 nats per token.
    for kind in ("niah_single", "niah_multikey", "niah_code"):
      assert out[f"{kind}/retrieval_nats_len{length}"] == pytest.approx(
          2.0 * out[f"{kind}/answer_nats_len{length}"])
    assert out[f"answer_nats_len{length}"] == pytest.approx(np.mean(
        [out[f"{k}/answer_nats_len{length}"] for k in ruler.TASKS]))
    # Standard errors: the oracle's per-example worth is 2 nats per answer token, so they spread
    # only with the answers' lengths; the task mean's combines the tasks'.
    ses = [out[f"{k}/retrieval_nats_se_len{length}"] for k in ruler.TASKS]
    assert all(np.isfinite(ses)) and out[f"retrieval_nats_se_len{length}"] == pytest.approx(
        np.sqrt(np.sum(np.square(ses))) / len(ses))
  wrong = ScriptedProbe(tokenizer, lambda p: " 12345\n", context=256, capacity=300)
  out = ruler.evaluate(wrong, lengths=(256,), examples=3, seed=0)
  assert out["accuracy_len256"] == 0.0 and out["retrieval_nats_len256"] == 0.0


def test_ruler_suite_on_the_small_model(small_model, tokenizer):
  """Through run_suites and the real probe (engine completions, chunked-head log-probs)."""
  cfg, params = small_model
  options = suites.SuiteOptions(context=64, long_lengths=(256,), long_examples=2, batch=2)
  out = suites.run_suites(["ruler"], cfg, params, tokenizer, options)
  for length in (256,):
    for kind in ruler.TASKS:
      assert 0.0 <= out[f"eval/ruler/{kind}/accuracy_len{length}"] <= 1.0
      assert out[f"eval/ruler/{kind}/answer_nats_len{length}"] > 1.0  # random init: ~ln V/token
      assert np.isfinite(out[f"eval/ruler/{kind}/retrieval_nats_len{length}"])
