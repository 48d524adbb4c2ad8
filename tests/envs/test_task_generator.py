"""The task generator: determinism, splits, the ladder, and the property that matters most:
every generated task is solved by its oracle (reward 1) and not by doing nothing (reward 0)."""
import concurrent.futures
import pathlib
import tempfile

import pytest

from c2.envs import grading, task_generator, tasks

ALL_KINDS = {kind for _, kind in task_generator.LADDER}
PER_CYCLE = len(task_generator.LADDER)


def replay(files, solution):
  """A tiny, independent applier of edit_file/write_file calls (no sandbox)."""
  files = dict(files)
  for call in solution:
    args = call["arguments"]
    if call["name"] == "write_file":
      files[args["path"]] = args["content"]
    elif call["name"] == "edit_file":
      assert files[args["path"]].count(args["search"]) == 1, (args["path"], args["search"])
      files[args["path"]] = files[args["path"]].replace(args["search"], args["replace"])
  return files


def grade_files(task, files):
  with tempfile.TemporaryDirectory() as root:
    tasks.write_files(root, files)
    return grading.grade(task, root, grading.run_subprocess)


def check_oracle_and_noop(task):
  solved = grade_files(task, replay(task.files, task.solution))
  untouched = grade_files(task, task.files)
  return task, solved, untouched


def assert_all_graded(task_list):
  # Two workers: each check is two short `python -m unittest` processes.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    for task, solved, untouched in pool.map(check_oracle_and_noop, task_list):
      assert solved.reward == 1.0, (task.task_id, solved.output[-2000:])
      assert solved.passed == solved.total == len(task.test_names) > 0
      assert untouched.reward == 0.0, (task.task_id, untouched.output[-2000:])


def test_oracle_solves_every_task_and_doing_nothing_scores_zero():
  task_list = [t for seed in (0, 1) for split in tasks.SPLITS
               for t in task_generator.generate(seed, PER_CYCLE, split=split)]
  assert {t.kind for t in task_list} == ALL_KINDS
  assert_all_graded(task_list)


@pytest.mark.slow
def test_oracle_sweep_many_seeds():
  assert_all_graded([t for seed in range(2, 8) for split in tasks.SPLITS
                     for t in task_generator.generate(seed, 2 * PER_CYCLE, split=split)])


def test_deterministic_and_prefix_stable():
  first = task_generator.generate(3, 2 * PER_CYCLE)
  assert first == task_generator.generate(3, 2 * PER_CYCLE)
  assert task_generator.generate(3, 5) == first[:5]
  other = task_generator.generate(4, 2 * PER_CYCLE)
  assert {t.task_id for t in first}.isdisjoint({t.task_id for t in other})


def test_splits_are_disjoint():
  train = [t for s in range(4) for t in task_generator.generate(s, 3 * PER_CYCLE, split="train")]
  heldout = [t for s in range(4)
             for t in task_generator.generate(s, 3 * PER_CYCLE, split="heldout")]
  assert {t.split for t in train} == {"train"} and {t.split for t in heldout} == {"heldout"}
  assert {t.task_id for t in train}.isdisjoint({t.task_id for t in heldout})
  content = lambda t: (t.prompt, tuple(sorted(t.files.items())))  # noqa: E731
  assert {content(t) for t in train}.isdisjoint({content(t) for t in heldout})
  # The split's unit is the family (kind, template, chosen names): none is in both splits.
  family = lambda t: next(tag for tag in t.tags if tag.startswith("family:"))  # noqa: E731
  assert {family(t) for t in train}.isdisjoint({family(t) for t in heldout})
  assert len({t.task_id for t in train}) == len(train)  # no duplicates within a split either


def test_split_hash_fraction():
  families = [("kind", str(i)) for i in range(4000)]
  heldout = sum(task_generator.split_of(f) == "heldout" for f in families) / len(families)
  assert abs(heldout - task_generator.HELDOUT_FRACTION) < 0.03


def test_ladder_levels_tags_and_filter():
  generated = task_generator.generate(0, PER_CYCLE)
  assert [(t.level, t.kind) for t in generated] == list(task_generator.LADDER)
  for t in generated:
    assert f"level:{t.level}" in t.tags and f"kind:{t.kind}" in t.tags
    assert t.solution[-1]["name"] == "finish"
    assert set(t.hidden_files) == {"tests/test_hidden.py"}
    assert not set(t.hidden_files) & set(t.files)
  assert {t.level for t in task_generator.generate(0, 6, levels=(1,))} == {1}
  with pytest.raises(ValueError, match="levels"):
    task_generator.generate(0, 2, levels=(7,))


def test_generated_python_compiles():
  for t in task_generator.generate(5, 2 * PER_CYCLE, split="heldout"):
    for path, text in {**t.files, **t.hidden_files}.items():
      if path.endswith(".py"):
        compile(text, f"{t.task_id}:{path}", "exec")


def test_cli_writes_jsonl(tmp_path: pathlib.Path):
  out = tmp_path / "tasks.jsonl"
  task_generator.main(["--seed", "0", "--count", "3", "--split", "heldout", "--out", str(out)])
  assert tasks.read_jsonl(out) == task_generator.generate(0, 3, split="heldout")


def test_level1_prompts_hold_the_copied_spans_as_the_tool_calls_tokenize_them(tokenizer_512):
  """What a level-1 policy copies from the prompt into its tool calls (the path; for
  set_constant the whole new line) is the same token sequence in both places: a BPE tokenizer
  gives ' orbit' and 'orbit' different ids, and copying across that needs a learned mapping
  the tiny model does not have. Checked on the calls the oracle makes, JSON-encoded as the chat
  template writes them; the old unquoted prompt ("... in orbit/settings.py ...") fails it."""
  import json  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  from c2.data.tokenizer import HuggingFaceTokenizer  # pylint: disable=import-outside-toplevel
  tok = HuggingFaceTokenizer.from_file(tokenizer_512)

  def contains(haystack, needle):
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack)))

  def span_tokens(prompt: str, span: str) -> list[int]:
    """The tokens of `span` as the prompt has them (it is quoted there, or it fails here)."""
    assert f"`{span}`" in prompt, (prompt, span)
    ids, opening, closing = tok.encode(f" `{span}`"), tok.encode(" `"), tok.encode("`")
    assert ids[:len(opening)] == opening and ids[-len(closing):] == closing
    return ids[len(opening):-len(closing)]

  bare = "Change the setting PAGE_SIZE in orbit/settings.py to 50."
  path_call = tok.encode(json.dumps({"path": "orbit/settings.py"}))
  assert not contains(path_call, tok.encode(bare)[5:10])  # the old prose: " orbit" != "orbit"
  for task in task_generator.generate(0, 24, split="heldout", levels=(1,)):
    prompt = tok.encode(task.prompt)
    for call in task.solution:
      if call["name"] == "finish":
        continue
      arguments = tok.encode(json.dumps(call["arguments"]))
      path = span_tokens(task.prompt, call["arguments"]["path"])
      assert contains(prompt, path) and contains(arguments, path), (task.prompt, call)
      if "kind:set_constant" in task.tags and call["name"] == "edit_file":
        line = span_tokens(task.prompt, call["arguments"]["replace"].rstrip("\n"))
        assert contains(prompt, line) and contains(arguments, line), (task.prompt, call)
