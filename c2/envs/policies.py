"""Scripted policies and the loop that runs one through an environment.

  OraclePolicy   replays the task's solution (tool calls written by the task generator) through
                 the tool interface, one turn per call (read-only calls batched in one turn, as
                 parallel calls), then finishes: it proves every generated task solvable through
                 the tools and the grader right (it must score 1.0).
  NoopPolicy     finishes at once without touching anything (it must score 0.0).
  run_episode    reset -> step until done -> reward, returning an `Episode`.

Policies speak Kimi template text by default (`as_text=True`), so the oracle also exercises the
parser a sampled reply goes through; `as_text=False` gives OpenAI-style message dicts.
"""
from __future__ import annotations

import dataclasses
import json
import random
import time
from typing import Callable, Iterator, Optional, Sequence

from c2.data.tool_calls import format_assistant_text
from c2.envs import rewards
from c2.envs.environment import READ_ONLY_TOOLS, CodingEnv
from c2.envs.tasks import Task

Policy = Callable[[list[dict]], object]  # messages -> a reply for CodingEnv.step


def _turns(solution: Sequence[dict]) -> Iterator[list[dict]]:
  """Groups consecutive read-only calls into one turn; every other call is a turn of its own."""
  batch: list[dict] = []
  for call in solution:
    if call["name"] in READ_ONLY_TOOLS:
      batch.append(call)
      continue
    if batch:
      yield batch
      batch = []
    yield [call]
  if batch:
    yield batch


def _reply(calls: Sequence[dict], reasoning: str, as_text: bool, thinking: bool):
  pairs = [(c["name"], json.dumps(c["arguments"])) for c in calls]
  if as_text:
    return format_assistant_text("", pairs, reasoning=reasoning, in_reasoning=thinking)
  return {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [
      {"id": f"functions.{name}:{i}", "type": "function",
       "function": {"name": name, "arguments": arguments}}
      for i, (name, arguments) in enumerate(pairs)]}


SLIP_KINDS = ("search_is_replacement", "replacement_is_search")


def slipped_edit(call: dict, kind: str = "search_is_replacement") -> dict:
  """An edit_file call that cannot apply, of one of the two mistakes of a small sampled policy
  (both measured on the tiny SFT models): it copies the new text where the old belongs or the
  old where the new belongs.

    search_is_replacement  it searches for its own replacement text: "the search text does not
                           occur" (the prompt's value or the new name copied into `search`).
    replacement_is_search  its replacement is its search text: "search and replace are
                           identical" (the file's current text copied into `replace`; the
                           failure of 50-62 of 64 held-out set_constant tasks in the policies
                           that pass few of them).
  A transcript with a slip then shows how to recover from the error.
  """
  arguments = call["arguments"]
  if kind == "search_is_replacement":
    return {"name": "edit_file", "arguments": {**arguments, "search": arguments["replace"]}}
  if kind == "replacement_is_search":
    return {"name": "edit_file", "arguments": {**arguments, "replace": arguments["search"]}}
  raise ValueError(f"unknown slip kind {kind!r}; choose from {SLIP_KINDS}")


class OraclePolicy:
  """Replays task.solution. With `slip_seed` set, one edit_file call (chosen by that seed) is
  preceded by a slipped_edit of itself, of a kind drawn from `slip_kinds` by the same seed;
  `slip_turns` then lists the reply indices of the slips, so a transcript can keep them as
  context without training on them (weight 0)."""

  def __init__(self, task: Task, *, as_text: bool = True, thinking: bool = True,
               slip_seed: Optional[int] = None,
               slip_kinds: Sequence[str] = ("search_is_replacement",)):
    if not task.solution:
      raise ValueError(f"task {task.task_id} has no oracle solution (external tasks have none)")
    solution = list(task.solution)
    if solution[-1]["name"] != "finish":
      solution.append({"name": "finish", "arguments": {"message": "Done."}})
    self.slip_turns: list[int] = []
    edits = [i for i, c in enumerate(solution) if c["name"] == "edit_file"
             and c["arguments"]["replace"] not in c["arguments"]["search"]]
    slip = None
    if slip_seed is not None and edits:
      draw = random.Random(slip_seed)
      at = edits[draw.randrange(len(edits))]
      # The kind is drawn after the edit, so one kind alone slips the edits it always did.
      kind = slip_kinds[draw.randrange(len(slip_kinds))] if len(slip_kinds) > 1 else slip_kinds[0]
      slip = slipped_edit(solution[at], kind)
      solution.insert(at, slip)
    self._turns = list(_turns(solution))
    if slip is not None:  # an edit is a turn of its own (_turns)
      self.slip_turns = [next(t for t, turn in enumerate(self._turns) if turn[0] is slip)]
    self._as_text, self._thinking, self._next = as_text, thinking, 0

  def __call__(self, messages: list[dict]):
    del messages  # scripted: the observations do not change the plan
    if self._next >= len(self._turns):
      raise RuntimeError("the oracle ran out of turns before the environment ended the rollout")
    calls = self._turns[self._next]
    self._next += 1
    names = ", ".join(c["name"] for c in calls)
    return _reply(calls, f"Next step: {names}.", self._as_text, self._thinking)


class NoopPolicy:
  def __init__(self, *, as_text: bool = True, thinking: bool = True):
    self._as_text, self._thinking = as_text, thinking

  def __call__(self, messages: list[dict]):
    del messages
    return _reply([{"name": "finish", "arguments": {"message": "Nothing to do."}}],
                  "I will stop here.", self._as_text, self._thinking)


@dataclasses.dataclass
class Episode:
  task_id: str
  reward: rewards.RewardBreakdown
  finish_reason: str
  turns: int
  tool_calls: int
  segments: list[list[dict]]
  tool_seconds: list[float]  # wall time of each step's tool execution
  wall_seconds: float
  grade_output: str = ""


def run_episode(env: CodingEnv, policy: Policy, *, close: bool = True,
                max_steps: Optional[int] = None) -> Episode:
  """Drives `env` with `policy` to the end and grades it."""
  start = time.perf_counter()
  messages = env.reset()
  tool_seconds, done, steps = [], False, 0
  while not done:
    reply = policy(list(env.messages))
    step_start = time.perf_counter()
    _, done, _ = env.step(reply)
    tool_seconds.append(time.perf_counter() - step_start)
    steps += 1
    if max_steps is not None and steps >= max_steps:
      break
  del messages
  try:
    reward = env.reward()
    grade = env.grade_result
    return Episode(env.task.task_id, reward, env.finish_reason, env.counts["turns"],
                   env.counts["tool_calls"], env.segments(), tool_seconds,
                   time.perf_counter() - start, grade.output if grade else "")
  finally:
    if close:
      env.close()
