"""The multi-turn coding environment an RL loop drives: reset -> step* -> reward.

    env = CodingEnv(task, EnvConfig())
    messages = env.reset()                      # system prompt + task
    while not done:
      reply = policy(messages)                  # generated Kimi template text, or a message dict
      observation, done, info = env.step(reply)
      messages = env.messages                   # the current segment's context
    breakdown = env.reward()                    # graded in the sandbox, with the length penalty
    env.close()

A reply's tool calls are read by the one Kimi parser (c2/data/tool_calls.py). Several calls in a
turn all run and all their results come back, read-only ones concurrently; a malformed or unknown
call, bad arguments or a path outside the workspace become an error observation and are counted,
never an exception. The rollout ends at `finish`, at a reply without tool calls, or at max_turns.

Self-summarization (composer2_report.md 4.9): when the context reaches `summary.trigger_tokens`
the environment asks for a summary; the next reply is the summary, and the context restarts from
system prompt + task + summary (+ the to-do list and the number of prior summaries). A rollout is
the chain of segments (`segments()`); the reward applies to the model tokens of every segment.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import pickle
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from c2.data import chat
from c2.data import tool_calls as tool_call_parser
from c2.envs import grading, rewards, sandbox, sandbox_host
from c2.envs.tasks import Task, write_workspace
from c2.envs.tools import ToolConfig, ToolError, Tools
from c2.envs.workspace import Snapshot, Workspace

DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent working in a repository. Use the tools to read, edit and run code. "
    "Make the change the user asks for, check it (for example by running the tests), then call "
    "finish with a short summary.")
DEFAULT_SUMMARY_REQUEST = (
    "Your context is almost full. Write a summary of your work so far that lets you continue "
    "from it alone: what the task is, what you changed (files and functions), what you found out, "
    "and what remains to do. Do not call tools in this reply.")
TOOL_DECLARATIONS = ("full", "compact", "none")
READ_ONLY_TOOLS = frozenset({"read_file", "list_dir", "grep"})  # safe to run concurrently


def approximate_tokens(text: str) -> int:
  """A tokenizer-free count (about 4 bytes per token for code); pass a real one when you have it."""
  return math.ceil(len(text.encode()) / 4)


@dataclasses.dataclass(frozen=True)
class SummaryConfig:
  trigger_tokens: Optional[int] = None  # context tokens that trigger a summary; None: never
  max_summaries: int = 8  # beyond this the rollout ends instead (reason "context_full")
  request: str = DEFAULT_SUMMARY_REQUEST
  carry_todos: bool = True  # restart state: the open to-do items
  carry_count: bool = True  # restart state: how many summaries came before


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  tools: ToolConfig = ToolConfig()
  max_turns: int = 30
  max_calls_per_turn: int = 16
  parallel_read_calls: bool = True
  system_prompt: str = DEFAULT_SYSTEM_PROMPT
  thinking: bool = True  # replies given as text start inside <think> (the generation prompt's)
  # How the prompt declares the tools: "full" schemas, "compact" (no descriptions: ~30% fewer
  # tokens), or "none" (a policy that learned the tools from transcripts, e.g. the tiny CPU one).
  tool_declaration: str = "full"
  summary: SummaryConfig = SummaryConfig()
  reward: rewards.RewardConfig = rewards.RewardConfig()
  grading_mode: str = "fraction"  # grading.REWARD_MODES


@dataclasses.dataclass
class _Call:
  id: str
  name: str
  arguments: Any  # parsed JSON, or None when malformed
  error: Optional[str] = None


# Template text, a parsed reply (c2.data.tool_calls.parse_assistant_ids of sampled ids), or an
# OpenAI-style assistant message {"content", "reasoning_content", "tool_calls"}.
Reply = Union[str, tool_call_parser.ParsedReply, Mapping[str, Any]]


class CodingEnv:
  """One rollout of one task. Not thread-safe; run one environment per thread."""

  def __init__(self, task: Task, config: EnvConfig = EnvConfig(), *,
               workspace: Optional[Workspace] = None,
               count_tokens: Callable[[str], int] = approximate_tokens):
    self.task, self.config, self.count_tokens = task, config, count_tokens
    self.workspace = workspace if workspace is not None else workspace_for(task)
    self.tools = Tools(self.workspace, config.tools)
    self.messages: list[dict] = []
    self.finished_segments: list[list[dict]] = []
    self.done, self.finish_reason, self.awaiting_summary = False, None, False
    self.counts = {name: 0 for name in ("thinking_tokens", "tool_call_tokens", "tool_output_tokens",
                                        "final_message_tokens", "tool_calls", "turns",
                                        "malformed_tool_calls", "summaries")}
    self.tool_names_used: list[str] = []
    self.final_message = ""
    self._context_count = (None, 0, 0)  # (the list counted, messages counted, their tokens)
    self._initial_files = self.workspace.files()  # for stats().files_changed
    self._reward: Optional[rewards.RewardBreakdown] = None
    self._grade: Optional[grading.GradeResult] = None

  # ------------------------------------------------------------------------------------ protocol
  def reset(self) -> list[dict]:
    self.messages = [{"role": "system", "content": self.config.system_prompt},
                     {"role": "user", "content": self.task.prompt}]
    return list(self.messages)

  def step(self, reply: Reply) -> tuple[list[dict], bool, dict]:
    """Applies one assistant reply. -> (observation: the messages the environment added, done,
    info: {"turn", "tool_errors", "finish_reason", "new_segment"})."""
    if self.done:
      raise RuntimeError("step() after the rollout ended; call reset() on a new environment")
    if not self.messages:
      raise RuntimeError("call reset() before step()")
    message, calls = self._parse(reply)
    self.messages.append(message)
    self.counts["turns"] += 1
    self.counts["thinking_tokens"] += self.count_tokens(message.get("reasoning_content", ""))
    info = {"turn": self.counts["turns"], "tool_errors": 0, "new_segment": False}
    if self.awaiting_summary:
      observation = self._restart_from_summary(message.get("content", ""))
      info["new_segment"] = True
      return observation, self.done, {**info, "finish_reason": self.finish_reason}
    observation = self._run_calls(calls, info) if calls else []
    self.messages += observation
    if not calls:  # a reply without tool calls is the final answer
      self._end("final_message", message.get("content", ""))
    elif any(c.name == "finish" and c.error is None for c in calls):
      finish = next(c for c in calls if c.name == "finish" and c.error is None)
      self._end("finish", finish.arguments.get("message", ""))
    elif self.counts["turns"] >= self.config.max_turns:
      self._end("max_turns", "")
    elif self._context_full():
      observation += self._request_summary()
    return observation, self.done, {**info, "finish_reason": self.finish_reason}

  def reward(self) -> rewards.RewardBreakdown:
    """Grades the workspace in the sandbox (hidden tests added to a copy) and combines the task
    reward with the length penalty and behaviour penalties. Computed once."""
    if self._reward is None:
      self._grade = grading.grade(self.task, self.workspace.root, _sandboxed(self.config),
                                  mode=self.config.grading_mode,
                                  scratch_dir=sandbox_host.workspace_parent())
      self._reward = rewards.total_reward(self._grade.reward, self.stats(), self.config.reward)
    return self._reward

  @property
  def grade_result(self) -> Optional[grading.GradeResult]:
    return self._grade

  def stats(self) -> rewards.RolloutStats:
    c = self.counts
    return rewards.RolloutStats(
        thinking_tokens=c["thinking_tokens"], tool_call_tokens=c["tool_call_tokens"],
        tool_output_tokens=c["tool_output_tokens"],
        final_message_tokens=c["final_message_tokens"], tool_calls=c["tool_calls"],
        turns=c["turns"], malformed_tool_calls=c["malformed_tool_calls"],
        tool_names_used=tuple(self.tool_names_used), code_written=tuple(self.tools.code_written),
        todo_items_created=self.tools.todos_created, todo_items_open=self.tools.open_todos,
        files_changed=_changed_files(self._initial_files, self.workspace.files()),
        final_message=self.final_message)

  def segments(self) -> list[list[dict]]:
    """Every context of the rollout in order: the finished ones, then the current one. Render a
    segment with c2.data.chat.render_chat(tokenizer, segment, env.tool_schemas()) for its token
    ids and the mask of model tokens (assistant replies, summaries included)."""
    return [list(s) for s in self.finished_segments] + [list(self.messages)]

  def segment_tokens(self, tokenizer) -> list:
    """Per segment, c2.data.chat.RenderedChat: token ids as the generation prompts render the
    context, and `assistant_mask` True on model tokens (every reply, summaries included), False on
    environment tokens (system, task, tool outputs, summary requests)."""
    return [chat.render_chat(tokenizer, segment, self.tool_schemas(), train_on="all_assistant")
            for segment in self.segments()]

  def tool_schemas(self) -> list[dict]:
    """The schemas the prompt declares (c2.data.chat renders them); the tools are the enabled
    ones whatever is declared."""
    declaration = self.config.tool_declaration
    if declaration not in TOOL_DECLARATIONS:
      raise ValueError(f"EnvConfig.tool_declaration={declaration!r}; choose {TOOL_DECLARATIONS}")
    if declaration == "none":
      return []
    return self.config.tools.schemas(descriptions=declaration == "full")

  def close(self) -> None:
    self.workspace.cleanup()

  # --------------------------------------------------------------------------------- checkpoints
  def checkpoint(self) -> bytes:
    """The rollout's state and a snapshot of its workspace, so a recovered run continues it."""
    state = {k: v for k, v in self.__dict__.items()
             if k not in ("task", "config", "count_tokens", "workspace", "tools")}
    tools = {k: v for k, v in self.tools.__dict__.items() if k not in ("workspace", "config")}
    return pickle.dumps({"state": state, "tools": tools,
                         "workspace": self.workspace.snapshot().to_bytes()})

  @classmethod
  def restore(cls, task: Task, config: EnvConfig, data: bytes, **kwargs) -> "CodingEnv":
    saved = pickle.loads(data)
    workspace = Workspace.create({})
    workspace.restore(Snapshot.from_bytes(saved["workspace"]))
    env = cls(task, config, workspace=workspace, **kwargs)
    env.__dict__.update(saved["state"])
    env.tools.__dict__.update(saved["tools"])
    return env

  # ----------------------------------------------------------------------------------- internals
  def _parse(self, reply: Reply) -> tuple[dict, list[_Call]]:
    """A reply (template text or an OpenAI-style message) -> (the assistant message, its calls)."""
    if isinstance(reply, (str, tool_call_parser.ParsedReply)):
      parsed = reply if not isinstance(reply, str) else tool_call_parser.parse_assistant_text(
          reply, in_reasoning=self.config.thinking)
      raw = [(c.id, c.name, c.arguments, c.complete) for c in parsed.tool_calls]
      message = {"role": "assistant", "content": parsed.content,
                 "reasoning_content": parsed.reasoning}
    else:
      message = {"role": "assistant", "content": reply.get("content") or "",
                 "reasoning_content": reply.get("reasoning_content") or ""}
      raw = [(c.get("id") or f"functions.{c['function']['name']}:{i}", c["function"]["name"],
              c["function"].get("arguments", "{}"), True)
             for i, c in enumerate(reply.get("tool_calls") or [])]
    calls = []
    for index, (call_id, name, arguments, complete) in enumerate(raw):
      self.counts["tool_call_tokens"] += self.count_tokens(
          name + (arguments if isinstance(arguments, str) else json.dumps(arguments)))
      call = _Call(call_id, name, None)
      if not complete:
        call.error = "the tool call is cut off (no <|tool_call_end|>); write the whole call"
      elif index >= self.config.max_calls_per_turn:
        call.error = f"more than {self.config.max_calls_per_turn} tool calls in one turn"
      else:
        try:
          call.arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as e:
          call.error = f"the arguments are not valid JSON ({e.msg} at character {e.pos})"
      calls.append(call)
    if calls:
      message["tool_calls"] = [
          {"id": c.id, "type": "function", "function": {
              "name": c.name, "arguments": arguments if isinstance(arguments, str)
              else json.dumps(arguments)}} for c, (_, _, arguments, _) in zip(calls, raw)]
    return message, calls

  def _execute(self, call: _Call) -> str:
    """Runs one call (maybe in a pool thread: no bookkeeping here, _run_calls does it in order)."""
    if call.error is None:
      try:
        return self.tools.call(call.name, call.arguments)
      except ToolError as e:
        call.error = str(e)
    return f"Error: {call.error}"

  def _run_calls(self, calls: Sequence[_Call], info: dict) -> list[dict]:
    """All calls of a turn, in order; runs of read-only calls go through a thread pool."""
    outputs: list[Optional[str]] = [None] * len(calls)
    i = 0
    while i < len(calls):
      j = i
      while (self.config.parallel_read_calls and j < len(calls) and calls[j].error is None
             and calls[j].name in READ_ONLY_TOOLS):
        j += 1
      if j - i > 1:
        with concurrent.futures.ThreadPoolExecutor(min(8, j - i)) as pool:
          outputs[i:j] = list(pool.map(self._execute, calls[i:j]))
        i = j
      else:
        outputs[i] = self._execute(calls[i])
        i += 1
    info["tool_errors"] = sum(c.error is not None for c in calls)
    observation = []
    for call, output in zip(calls, outputs):
      if call.error is None:
        self.tool_names_used.append(call.name)
        self.counts["tool_calls"] += 1
      else:
        self.counts["malformed_tool_calls"] += 1
      self.counts["tool_output_tokens"] += self.count_tokens(output)
      observation.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return observation

  def _context_tokens(self) -> int:
    """Tokens of the current context, counting only the messages added since the last call (the
    context only grows until a restart replaces the list; a real tokenizer is not cheap)."""
    counted_list, counted, total = self._context_count
    if counted_list is not self.messages:
      counted, total = 0, 0
    total += sum(self.count_tokens(json.dumps(m)) for m in self.messages[counted:])
    self._context_count = (self.messages, len(self.messages), total)
    return total

  def _context_full(self) -> bool:
    trigger = self.config.summary.trigger_tokens
    return trigger is not None and self._context_tokens() >= trigger

  def _request_summary(self) -> list[dict]:
    if self.counts["summaries"] >= self.config.summary.max_summaries:
      self._end("context_full", "")
      return []
    self.awaiting_summary = True
    request = {"role": "user", "content": self.config.summary.request}
    self.messages.append(request)
    return [request]

  def _restart_from_summary(self, summary: str) -> list[dict]:
    self.awaiting_summary = False
    self.counts["summaries"] += 1
    self.finished_segments.append(self.messages)
    state = []
    if self.config.summary.carry_count:
      state.append(f"This is context {self.counts['summaries'] + 1}; "
                   f"{self.counts['summaries']} summaries came before it.")
    if self.config.summary.carry_todos and self.tools.todos:
      state.append("To-do list:\n" + "\n".join(f"[{t['status']}] {t['content']}"
                                              for t in self.tools.todos))
    restart = (f"{self.task.prompt}\n\nSummary of your work so far:\n{summary}" +
               "".join(f"\n\n{part}" for part in state))
    self.messages = [{"role": "system", "content": self.config.system_prompt},
                     {"role": "user", "content": restart}]
    return list(self.messages)

  def _end(self, reason: str, final_message: str) -> None:
    self.done, self.finish_reason, self.final_message = True, reason, final_message
    self.counts["final_message_tokens"] += self.count_tokens(final_message)


def workspace_for(task: Task, parent=None) -> Workspace:
  """A fresh workspace holding the task's files, laid out as c2.envs.tasks.write_workspace lays
  them out for grading and the SWE-bench loader (a tarball's single top-level folder stripped)."""
  workspace = Workspace.create({}, parent)
  try:
    write_workspace(task, workspace.root)
  except BaseException:
    workspace.cleanup()
    raise
  return workspace


def make_group(task: Task, size: int, config: EnvConfig = EnvConfig(), **kwargs) -> list[CodingEnv]:
  """The G environments of one group, their workspaces forked from one snapshot of the task."""
  base = workspace_for(task)
  try:
    return [CodingEnv(task, config, workspace=ws, **kwargs) for ws in base.fork(size)]
  finally:
    base.cleanup()


def _sandboxed(config: EnvConfig) -> grading.RunCommandFn:
  limits = config.tools.run_limits

  def run(command: str, root) -> tuple[int, str]:
    result = sandbox.run_command(command, root, limits)
    return result.exit_code, result.output

  return run


def _changed_files(before: Mapping[str, bytes], after: Mapping[str, bytes]) -> int:
  return sum(before.get(name) != after.get(name) for name in set(before) | set(after))
