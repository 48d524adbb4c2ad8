"""The coding environment end to end: oracle and do-nothing rewards over the whole ladder, malformed
replies, parallel calls, endings, self-summarization over several segments, checkpoint/restore,
groups and the reward breakdown. Every episode runs its tools and grader in the real sandbox."""
import concurrent.futures
import json
import re
import threading
import time

import pytest

from c2.data import chat, default_tokenizer, kimi_vocab
from c2.data.tokenizer import HuggingFaceTokenizer
from c2.data.tool_calls import format_assistant_text
from c2.envs import rewards, task_generator, tasks
from c2.envs.environment import (DEFAULT_SUMMARY_REQUEST, CodingEnv, EnvConfig, SummaryConfig,
                                 approximate_tokens, make_group)
from c2.envs.policies import NoopPolicy, OraclePolicy, run_episode

LADDER_SIZE = len(task_generator.LADDER)
TASKS = {split: task_generator.generate(0, LADDER_SIZE, split=split) for split in tasks.SPLITS}


def task_of(kind, split="train"):
  return next(t for t in TASKS[split] if t.kind == kind)


def reply(*calls, content="", reasoning="Thinking."):
  """A reply as generated template text; calls: (name, arguments as a dict or raw JSON text)."""
  pairs = [(name, a if isinstance(a, str) else json.dumps(a)) for name, a in calls]
  return format_assistant_text(content, pairs, reasoning=reasoning, in_reasoning=True)


def cut_off_reply(calls, cut_name, cut_arguments):
  """A reply whose last call was cut by max_tokens: no <|tool_call_end|>, section end or im_end."""
  text = reply(*calls).removesuffix(kimi_vocab.TOOL_CALLS_SECTION_END + kimi_vocab.IM_END)
  return (text + f"{kimi_vocab.TOOL_CALL_BEGIN}functions.{cut_name}:{len(calls)}"
          f"{kimi_vocab.TOOL_CALL_ARGUMENT_BEGIN}{cut_arguments}")


def normalized(segments):
  """Without what differs between two runs of one rollout: unittest's "Ran 3 tests in 0.004s"
  and the workspace directory in tracebacks."""
  text = re.sub(r"in \d+\.\d+s", "in _s", json.dumps(segments))
  return json.loads(re.sub(r"/ws-[A-Za-z0-9_]+/", "/ws-_/", text))


@pytest.fixture
def env():
  environment = CodingEnv(task_of("set_constant"))
  environment.reset()
  yield environment
  environment.close()


# ---- oracle 1.0, nothing 0.0 ---------------------------------------------------------------------

def oracle_and_noop(task, as_text):
  oracle = run_episode(CodingEnv(task), OraclePolicy(task, as_text=as_text))
  noop = run_episode(CodingEnv(task), NoopPolicy(as_text=not as_text))
  return task, oracle, noop


def check_oracle_and_noop(task_list):
  assert {t.kind for t in task_list} == {kind for _, kind in task_generator.LADDER}
  with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the machine has two cores
    results = pool.map(oracle_and_noop, task_list, [i % 2 == 0 for i in range(len(task_list))])
    for task, oracle, noop in results:
      assert oracle.reward.task == 1.0, (task.task_id, oracle.grade_output[-2000:])
      assert noop.reward.task == 0.0, (task.task_id, noop.grade_output[-2000:])
      assert (oracle.finish_reason, noop.finish_reason) == ("finish", "finish")
      assert oracle.tool_calls == len(task.solution)  # every call ran, none was malformed
      assert oracle.reward.penalties["malformed_tool_calls"] == 0.0
      assert (noop.turns, noop.tool_calls) == (1, 1)


def test_oracle_scores_one_and_doing_nothing_zero_on_the_whole_ladder():
  check_oracle_and_noop(TASKS["train"] + TASKS["heldout"])


@pytest.mark.slow
def test_oracle_and_noop_many_seeds():
  check_oracle_and_noop([t for seed in range(1, 5) for split in tasks.SPLITS
                         for t in task_generator.generate(seed, LADDER_SIZE, split=split)])


def test_text_and_dict_replies_give_the_same_rollout():
  task = task_of("fix_bug")  # explores, edits, runs the visible tests, finishes
  as_text = run_episode(CodingEnv(task), OraclePolicy(task, as_text=True))
  as_dicts = run_episode(CodingEnv(task), OraclePolicy(task, as_text=False))
  assert normalized(as_text.segments) == normalized(as_dicts.segments)
  assert as_text.reward.task == as_dicts.reward.task == 1.0
  called = [c["function"]["name"] for m in as_text.segments[0] for c in m.get("tool_calls", [])]
  assert called == [c["name"] for c in task.solution] and "run" in called


# ---- malformed replies ---------------------------------------------------------------------------

def test_malformed_calls_become_errors_and_the_others_still_run(env):
  settings = "transit/settings.py"
  text = cut_off_reply([
      ("list_dir", {"path": "transit"}),
      ("read_file", '{"path": "transit/settings.py"'),  # invalid JSON
      ("delete_file", {"path": settings}),  # unknown tool
      ("read_file", {"path": settings, "start_line": "1"}),  # wrong type
      ("read_file", {"path": "/etc/passwd"}),  # outside the workspace
      ("read_file", {"path": settings, "end_line": 1}),
  ], "edit_file", '{"path": "transit/settings.py", "search": "API_VER')
  observation, done, info = env.step(text)
  assert [m["tool_call_id"] for m in observation] == [
      "functions.list_dir:0", "functions.read_file:1", "functions.delete_file:2",
      "functions.read_file:3", "functions.read_file:4", "functions.read_file:5",
      "functions.edit_file:6"]
  assert all(m["role"] == "tool" for m in observation)
  contents = [m["content"] for m in observation]
  assert contents[0] == "__init__.py\nsettings.py"
  assert contents[1].startswith("Error: the arguments are not valid JSON (Expecting ',' delimiter")
  assert contents[2].startswith("Error: unknown tool 'delete_file'; available: read_file, ")
  assert contents[3] == "Error: read_file: argument 'start_line' must be a integer, got str"
  assert contents[4].startswith("Error: read_file: path '/etc/passwd' is not allowed: absolute")
  assert contents[5].startswith("    1\t") and "Error" not in contents[5]
  assert contents[6] == ("Error: the tool call is cut off (no <|tool_call_end|>); write the whole "
                         "call")
  assert env.messages[-7:] == observation
  assert (done, info["tool_errors"]) == (False, 5)
  assert (env.counts["malformed_tool_calls"], env.counts["tool_calls"]) == (5, 2)
  assert env.tool_names_used == ["list_dir", "read_file"]
  assert env.workspace.files()[settings] == env.task.files[settings].encode()  # no edit applied

  # The same mistakes as an OpenAI-style message, then the episode goes on normally.
  observation, done, _ = env.step({"role": "assistant", "content": "", "tool_calls": [
      {"id": "c1", "function": {"name": "read_file", "arguments": "{bad"}},
      {"id": "c2", "function": {"name": "write_file",
                                "arguments": {"path": "../x", "content": ""}}},  # a dict
  ]})
  assert [m["tool_call_id"] for m in observation] == ["c1", "c2"]
  assert observation[0]["content"].startswith("Error: the arguments are not valid JSON")
  assert "'..' is not allowed" in observation[1]["content"]
  assert not done and env.counts["malformed_tool_calls"] == 7
  observation, done, info = env.step(reply(("finish", {"message": "bye"})))
  assert (observation[0]["content"], done, info["finish_reason"]) == ("bye", True, "finish")
  assert env.stats().malformed_tool_calls == 7 and env.stats().tool_calls == 3
  assert env.reward().penalties["malformed_tool_calls"] == pytest.approx(0.1 * 7 / 10)


def test_calls_that_would_raise_inside_a_tool_are_errors(env):
  """Text no file, path or process can take (a lone surrogate, a NUL) is refused, not raised."""
  observation, done, _ = env.step(reply(
      ("write_file", '{"path": "s.txt", "content": "\\ud83d"}'),
      ("read_file", '{"path": "\\ud800"}'), ("run", '{"command": "echo a\\u0000b"}'),
      ("todo_write", '{"items": [{"content": "\\udfff"}]}'), ("list_dir", {})))
  assert [m["content"].split(":")[0] for m in observation[:4]] == ["Error"] * 4
  assert "lone surrogate" in observation[0]["content"]
  assert "NUL byte" in observation[2]["content"]
  assert "transit/" in observation[4]["content"].splitlines()
  assert not done and env.counts["malformed_tool_calls"] == 4


# ---- several calls in one turn -------------------------------------------------------------------

def test_read_only_calls_of_a_turn_run_concurrently_and_come_back_in_order(env):
  barrier = threading.Barrier(3, timeout=20)  # passes only if three calls run at the same time
  lock, active, seen, use_barrier = threading.Lock(), [0], [], [True]

  def fake_call(name, arguments):
    with lock:
      active[0] += 1
      seen.append((name, active[0], threading.get_ident()))
    try:
      if use_barrier[0]:
        barrier.wait()
      if arguments.get("path") == "a":
        time.sleep(0.2)  # the first call finishes last; its result still comes first
      return f"{name}:{arguments.get('path')}"
    finally:
      with lock:
        active[0] -= 1

  env.tools.call = fake_call
  observation, _, info = env.step(reply(("read_file", {"path": "a"}), ("grep", {
      "pattern": "x", "path": "b"}), ("list_dir", {"path": "c"})))
  assert [(m["tool_call_id"], m["content"]) for m in observation] == [
      ("functions.read_file:0", "read_file:a"), ("functions.grep:1", "grep:b"),
      ("functions.list_dir:2", "list_dir:c")]
  assert len({thread for _, _, thread in seen}) == 3 and info["tool_errors"] == 0
  assert env.tool_names_used == ["read_file", "grep", "list_dir"]  # call order, not finish order

  # A write splits the run: it never overlaps a read, and single calls stay on this thread.
  seen.clear()
  use_barrier[0] = False
  env.step(reply(("read_file", {"path": "d"}), ("edit_file", {"path": "e", "search": "s",
                                                                "replace": "r"}),
                 ("read_file", {"path": "f"})))
  assert [(name, peak) for name, peak, _ in seen] == [
      ("read_file", 1), ("edit_file", 1), ("read_file", 1)]
  assert {thread for _, _, thread in seen} == {threading.get_ident()}


def test_parallel_reads_can_be_turned_off():
  environment = CodingEnv(task_of("set_constant"), EnvConfig(parallel_read_calls=False))
  threads = []
  environment.tools.call = lambda name, arguments: threads.append(threading.get_ident()) or "ok"
  environment.reset()
  observation, _, _ = environment.step(reply(*[("list_dir", {})] * 4))
  assert [m["content"] for m in observation] == ["ok"] * 4
  assert threads == [threading.get_ident()] * 4
  environment.close()


def test_calls_beyond_max_calls_per_turn_are_errors():
  environment = CodingEnv(task_of("set_constant"), EnvConfig(max_calls_per_turn=2))
  environment.reset()
  observation, done, info = environment.step(reply(
      ("list_dir", {}), ("list_dir", {"path": "transit"}), ("list_dir", {}),
      ("write_file", {"path": "late.txt", "content": "x"})))
  assert [m["content"] for m in observation] == [
      "tests/\ntransit/", "__init__.py\nsettings.py",
      "Error: more than 2 tool calls in one turn", "Error: more than 2 tool calls in one turn"]
  assert [m["tool_call_id"] for m in observation] == [
      f"functions.{name}:{i}" for i, name in enumerate(["list_dir"] * 3 + ["write_file"])]
  assert not (environment.workspace.root / "late.txt").exists()
  assert (done, info["tool_errors"], environment.counts["malformed_tool_calls"]) == (False, 2, 2)
  environment.close()


# ---- how a rollout ends --------------------------------------------------------------------------

def test_a_reply_without_tool_calls_ends_the_rollout(env):
  observation, done, info = env.step(reply(content="The setting is already right."))
  assert (observation, done, info["finish_reason"]) == ([], True, "final_message")
  assert env.final_message == "The setting is already right."
  assert env.messages[-1] == {"role": "assistant", "content": "The setting is already right.",
                              "reasoning_content": "Thinking."}
  with pytest.raises(RuntimeError, match="step\\(\\) after the rollout ended"):
    env.step(reply(("list_dir", {})))
  assert env.counts["turns"] == 1


def test_finish_ends_the_rollout_after_the_other_calls_of_its_turn(env):
  _, done, info = env.step(reply(("write_file", {"path": "notes.txt", "content": "n"}),
                                 ("finish", {"message": "Wrote notes."})))
  assert (done, info["finish_reason"], env.final_message) == (True, "finish", "Wrote notes.")
  assert (env.workspace.root / "notes.txt").read_text() == "n"


def test_max_turns_ends_the_rollout():
  environment = CodingEnv(task_of("set_constant"), EnvConfig(max_turns=2))
  with pytest.raises(RuntimeError, match="call reset\\(\\) before step\\(\\)"):
    environment.step(reply(("list_dir", {})))
  environment.reset()
  assert environment.step(reply(("list_dir", {})))[1:] == (False, {
      "turn": 1, "tool_errors": 0, "new_segment": False, "finish_reason": None})
  observation, done, info = environment.step(reply(("list_dir", {})))
  assert (len(observation), done, info["finish_reason"]) == (1, True, "max_turns")
  with pytest.raises(RuntimeError, match="after the rollout ended"):
    environment.step(reply(("list_dir", {})))
  assert environment.reward().task == 0.0
  environment.close()


# ---- self-summarization --------------------------------------------------------------------------

TODOS = [{"content": "change the function", "status": "in_progress"},
         {"content": "pass it through the callers", "status": "pending"}]


class SummarizingOracle:
  """Writes a to-do list, then replays the oracle; answers each summary request with a summary."""

  def __init__(self, task):
    self.oracle, self.summaries, self.started = OraclePolicy(task), [], False

  def __call__(self, messages):
    if messages[-1] == {"role": "user", "content": DEFAULT_SUMMARY_REQUEST}:
      self.summaries.append(f"Summary {len(self.summaries) + 1}: replaying the plan.")
      return reply(content=self.summaries[-1], reasoning="Time to summarize.")
    if not self.started:
      self.started = True
      return reply(("todo_write", {"items": TODOS}))
    return self.oracle(messages)


def summary_config(task, **kwargs):
  """A trigger about 150 tokens above the starting context: a summary every turn or two."""
  probe = CodingEnv(task)
  start = sum(approximate_tokens(json.dumps(m)) for m in probe.reset())
  probe.close()
  return EnvConfig(summary=SummaryConfig(trigger_tokens=start + 150, **kwargs))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  """The embedded default tokenizer, trained tiny (0.1 s): enough to render the template."""
  path = default_tokenizer.ensure_default_tokenizer(
      tmp_path_factory.mktemp("tokenizer"), vocab_size=300, max_train_bytes=20_000)
  return HuggingFaceTokenizer.from_file(path)


def decoded_runs(tokenizer, rendered, trained):
  """Decoded runs of consecutive tokens whose mask equals `trained`."""
  runs, current = [], []
  for token, mask in zip(rendered.token_ids, rendered.assistant_mask):
    if mask == trained:
      current.append(token)
    elif current:
      runs.append(tokenizer.decode(current))
      current = []
  return runs + ([tokenizer.decode(current)] if current else [])


def test_self_summarization_over_several_segments(tokenizer):
  task = task_of("add_parameter")  # explore, five edits in three files, finish
  environment = CodingEnv(task, summary_config(task))
  policy = SummarizingOracle(task)
  episode = run_episode(environment, policy, close=False)
  segments = environment.segments()
  summaries = policy.summaries
  assert episode.finish_reason == "finish" and episode.reward.task == 1.0
  assert len(summaries) >= 3 and environment.counts["summaries"] == len(summaries)
  assert len(segments) == len(summaries) + 1 and segments[-1] == environment.messages
  system = {"role": "system", "content": environment.config.system_prompt}
  assert segments[0][:2] == [system, {"role": "user", "content": task.prompt}]
  for k, segment in enumerate(segments):
    if k:  # restarted: system, then task + summary + carried state, as one user message
      assert segment[:2] == [system, {"role": "user", "content": (
          f"{task.prompt}\n\nSummary of your work so far:\n{summaries[k - 1]}\n\n"
          f"This is context {k + 1}; {k} summaries came before it.\n\nTo-do list:\n"
          "[in_progress] change the function\n[pending] pass it through the callers")}]
    if k < len(summaries):  # finished: ends with the request and the summary reply
      assert segment[-2] == {"role": "user", "content": DEFAULT_SUMMARY_REQUEST}
      assert segment[-1] == {"role": "assistant", "content": summaries[k],
                             "reasoning_content": "Time to summarize."}
  # Every policy turn is in exactly one segment, in order; the edits span several segments.
  assistant = [m for s in segments for m in s if m["role"] == "assistant"]
  assert len(assistant) == environment.counts["turns"] == len(policy.oracle._turns) + 1 + len(
      summaries)
  edit_segments = {k for k, s in enumerate(segments) for m in s if m["role"] == "assistant"
                   and any(c["function"]["name"] == "edit_file" for c in m.get("tool_calls", []))}
  assert len(edit_segments) >= 2
  assert sum(m["role"] == "tool" for s in segments for m in s) == len(task.solution) + 1
  assert environment.stats().todo_items_created == 2

  # Rendered for training: the mask covers every reply (the summaries too), no tool output.
  for k, (segment, rendered) in enumerate(zip(segments, environment.segment_tokens(tokenizer))):
    assert rendered == chat.render_chat(tokenizer, segment, environment.tool_schemas())
    trained = decoded_runs(tokenizer, rendered, True)
    untrained = "".join(decoded_runs(tokenizer, rendered, False))
    assert len(trained) == sum(m["role"] == "assistant" for m in segment)
    if k < len(summaries):
      assert trained[-1].endswith(summaries[k] + kimi_vocab.IM_END)
    for message in segment:
      if message["role"] == "tool":
        assert f"## Return of {message['tool_call_id']}\n{message['content']}" in untrained
        if not message["tool_call_id"].startswith("functions.finish"):  # echoes its argument
          assert all(message["content"] not in run for run in trained)
  environment.close()


def test_max_summaries_ends_the_rollout_with_context_full():
  task = task_of("add_parameter")
  config = summary_config(task, max_summaries=1)
  environment = CodingEnv(task, config)
  policy = SummarizingOracle(task)
  episode = run_episode(environment, policy, close=False)
  assert episode.finish_reason == "context_full" and len(policy.summaries) == 1
  assert environment.counts["summaries"] == 1 and len(environment.segments()) == 2
  assert environment.messages[-1]["role"] == "tool"  # no second request: it ended instead
  assert episode.reward.task == environment.grade_result.reward
  assert episode.reward.total == rewards.total_reward(
      environment.grade_result.reward, environment.stats(), config.reward).total
  environment.close()


# ---- checkpoint / restore ------------------------------------------------------------------------

def test_checkpoint_and_restore_mid_rollout_continue_exactly():
  task = task_of("add_parameter")
  config = summary_config(task)  # with summaries, so finished segments travel too
  reference = run_episode(CodingEnv(task, config), SummarizingOracle(task))

  first, policy = CodingEnv(task, config), SummarizingOracle(task)
  first.reset()
  for _ in range(5):
    first.step(policy(first.messages))
  assert first.counts["summaries"] >= 1 and not first.done
  messages, counts, files = list(first.messages), dict(first.counts), first.workspace.files()
  data = first.checkpoint()
  first.close()
  assert not first.workspace.root.exists()

  resumed = CodingEnv.restore(task, config, data)
  assert resumed.workspace.root != first.workspace.root
  assert (resumed.messages, resumed.counts, resumed.workspace.files()) == (messages, counts, files)
  assert resumed.tools.todos == TODOS
  done = False
  while not done:
    _, done, _ = resumed.step(policy(resumed.messages))
  assert resumed.reward().task == 1.0 and resumed.finish_reason == "finish"
  assert normalized(resumed.segments()) == normalized(reference.segments)
  assert resumed.counts["turns"] == reference.turns
  resumed.close()


# ---- groups --------------------------------------------------------------------------------------

def test_make_group_gives_independent_workspaces_with_the_same_files():
  task = task_of("set_constant")
  group = make_group(task, 4)
  try:
    assert len({e.workspace.root for e in group}) == 4
    start = {path: text.encode() for path, text in task.files.items()}
    assert all(e.workspace.files() == start for e in group)
    for e in group:
      e.reset()
    group[0].step(reply(("write_file", {"path": "transit/settings.py", "content": "changed\n"}),
                        ("write_file", {"path": "extra.py", "content": "new\n"})))
    assert group[0].workspace.files() == {**start, "transit/settings.py": b"changed\n",
                                          "extra.py": b"new\n"}
    assert all(e.workspace.files() == start for e in group[1:])
    assert all(e.counts["turns"] == 0 for e in group[1:])
  finally:
    for e in group:
      e.close()
  assert not any(e.workspace.root.exists() for e in group)


# ---- the reward ----------------------------------------------------------------------------------

def test_reward_breakdown_matches_total_reward_on_the_stats():
  task = task_of("rename_symbol")
  environment = CodingEnv(task)
  episode = run_episode(environment, OraclePolicy(task), close=False)
  breakdown, grade = environment.reward(), environment.grade_result
  assert breakdown is episode.reward is environment.reward()  # graded once
  assert breakdown.task == grade.reward == 1.0 and grade.passed == grade.total > 0
  assert breakdown.length_penalty > 0 and breakdown.effort > 0
  assert breakdown.total == pytest.approx(
      breakdown.task - breakdown.length_penalty - sum(breakdown.penalties.values()))
  assert breakdown == rewards.total_reward(grade.reward, environment.stats(),
                                           environment.config.reward)
  stats = environment.stats()
  assert (stats.turns, stats.tool_calls, stats.malformed_tool_calls) == (
      episode.turns, len(task.solution), 0)
  assert stats.tool_names_used == tuple(c["name"] for c in task.solution)
  assert stats.files_changed == len({c["arguments"]["path"] for c in task.solution
                                     if c["name"] in ("edit_file", "write_file")})
  assert stats.final_message == task.solution[-1]["arguments"]["message"]
  environment.close()


def test_behaviour_penalties_reach_the_reward(env):
  env.step(reply(("todo_write", {"items": TODOS})))
  env.step(reply(("nope", {})))
  env.step(reply(("write_file", {"path": "transit/notes.py",
                                 "content": "# Notes\nx = 1  # let me think about this\n"})))
  env.step(reply(("finish", {"message": "stopped"})))
  breakdown, stats = env.reward(), env.stats()
  assert breakdown.task == 0.0
  assert (stats.todo_items_created, stats.todo_items_open, stats.files_changed) == (2, 2, 1)
  assert (stats.tool_calls, stats.malformed_tool_calls) == (3, 1)
  assert breakdown.penalties == pytest.approx({
      "malformed_tool_calls": 0.1 * 1 / 4, "unfinished_todos": 0.05 * 2 / 2,
      "thinking_in_comments": 0.1 * 1 / 2, "shell_only": 0.0})
  assert breakdown.total == pytest.approx(-breakdown.length_penalty - 0.025 - 0.05 - 0.05)


def test_changing_files_only_through_the_shell_is_penalised(env):
  env.step(reply(("run", {"command": "sed -i s/v1/v3/ transit/settings.py"})))
  env.step(reply(("finish", {"message": "edited with sed"})))
  breakdown, stats = env.reward(), env.stats()
  assert stats.files_changed == 1 and stats.tool_names_used == ("run", "finish")
  assert breakdown.penalties["shell_only"] == 0.1
  assert breakdown.total == pytest.approx(
      breakdown.task - breakdown.length_penalty - 0.1)


def test_a_tarball_snapshot_is_laid_out_as_the_grader_sees_it(tmp_path):
  """GitHub-style archives hold one top-level folder: the environment's workspace strips it, as
  the task loader and the grader do, so hidden test paths line up."""
  import tarfile
  source = tmp_path / "repo-main"
  (source / "pkg").mkdir(parents=True)
  (source / "pkg" / "mod.py").write_text("A = 1\n")
  archive = tmp_path / "snapshot.tar.gz"
  with tarfile.open(archive, "w:gz") as tar:
    tar.add(source, arcname="repo-main")
  task = tasks.Task(task_id="tar", prompt="p", files={"extra.txt": "x\n"}, files_path=str(archive))
  env = CodingEnv(task)
  try:
    assert env.workspace.files() == {"pkg/mod.py": b"A = 1\n", "extra.txt": b"x\n"}
  finally:
    env.close()
