"""Rollout rewards: task reward, Composer 2's nonlinear length penalty, and behaviour penalties.

  total = task - coefficient * C_{k,q}(x) - sum_name weight_name * penalty_name(stats)

The task reward (fraction of hidden tests passed, or pass/fail) comes from c2/envs/grading.py.

Length penalty (research notes section 4.8): C(x) = ((1 + k x)^(1-q) - 1) / (k (1 - q)), with
x a weighted sum of a rollout's thinking, tool-call, tool-output and final-message tokens, tool
calls and turns. C(0) = 0 and C'(x) = (1 + k x)^-q: each unit of effort costs 1 at first and less
as the rollout grows, so effort is felt strongly on easy tasks and weakly on long ones. q -> 0 is
linear (C = x), q = 1 is log1p(k x) / k, q > 1 is bounded by 1 / (k (q - 1)).

Behaviour penalties are a registry (`BEHAVIOUR_PENALTIES`, extended with `@register`), because
the report adds them reactively as failure modes show up during RL; each is a function of the
rollout's statistics returning a value in [0, 1], weighted in the config and logged on its own.
The report gives no values for k, q, the weights or the coefficient; the defaults here are ours.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Mapping

import numpy as np

EFFORT_COMPONENTS = ("thinking_tokens", "tool_call_tokens", "tool_output_tokens",
                     "final_message_tokens", "tool_calls", "turns")
FILE_TOOLS = frozenset({"read_file", "edit_file", "write_file", "list_dir", "grep"})
# Below this |1 - q| the closed form is replaced by its q = 1 limit (the relative error of doing
# so is about |1 - q| * log1p(k x) / 2, i.e. < 1e-11 for any realistic x).
_LOG_LIMIT_TOL = 1e-12


def length_penalty(x, k: float, q: float):
  """C_{k,q}(x) for x >= 0 (float or array; returns the same kind), k > 0, q >= 0.

  Written as expm1((1 - q) log1p(k x)) / (k (1 - q)), which stays accurate as q -> 1 (where the
  plain form subtracts nearly equal numbers) and as k x -> 0.
  """
  if k <= 0 or q < 0:
    raise ValueError(f"length penalty needs k > 0 and q >= 0, got k={k}, q={q}")
  values = np.asarray(x, dtype=np.float64)
  if np.any(values < 0) or not np.all(np.isfinite(values)):
    raise ValueError("length penalty effort x must be finite and >= 0")
  log_term = np.log1p(k * values)
  a = 1.0 - q
  if abs(a) < _LOG_LIMIT_TOL:
    result = log_term / k
  else:
    result = np.expm1(a * log_term) / (k * a)
  return float(result) if np.ndim(x) == 0 else result


# Tokens count once each; a tool call or a turn costs as much as a short message, so parallel
# tool calls (several per turn) come out cheaper than the same calls spread over many turns.
# Tool output is weighted lower because the environment, not the policy, writes it.
DEFAULT_WEIGHTS = {"thinking_tokens": 1.0, "tool_call_tokens": 1.0, "tool_output_tokens": 0.1,
                   "final_message_tokens": 1.0, "tool_calls": 20.0, "turns": 50.0}


@dataclasses.dataclass(frozen=True)
class LengthPenaltyConfig:
  """coefficient * C_{k,q}(sum_c weights[c] * stats.c); weights default to the DEFAULT_WEIGHTS."""

  coefficient: float = 1e-4
  k: float = 1e-3
  q: float = 1.0
  weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
  apply_to_failed: bool = True  # the report does not say; False exempts rollouts with task == 0

  def __post_init__(self):
    if self.coefficient < 0 or self.k <= 0 or self.q < 0:
      raise ValueError(f"length penalty: coefficient >= 0, k > 0 and q >= 0 required, got "
                       f"coefficient={self.coefficient}, k={self.k}, q={self.q}")
    unknown = set(self.weights) - set(EFFORT_COMPONENTS)
    if unknown or any(w < 0 for w in self.weights.values()):
      raise ValueError(f"length penalty weights: keys from {EFFORT_COMPONENTS}, values >= 0; "
                       f"got {dict(self.weights)}")


@dataclasses.dataclass(frozen=True)
class RolloutStats:
  """What the environment counted over one rollout (all segments of a summarised chain)."""

  thinking_tokens: int = 0
  tool_call_tokens: int = 0
  tool_output_tokens: int = 0
  final_message_tokens: int = 0
  tool_calls: int = 0  # well-formed calls, executed
  turns: int = 0  # policy generations
  malformed_tool_calls: int = 0  # unparseable, unknown tool or bad arguments
  tool_names_used: tuple[str, ...] = ()  # one entry per executed call, in order
  code_written: tuple[str, ...] = ()  # texts written by edit_file (replace) and write_file
  files_changed: int = 0  # workspace files that differ from the start at the end
  todo_items_created: int = 0
  todo_items_open: int = 0  # created and still not done at the end
  final_message: str = ""

  def effort(self, weights: Mapping[str, float]) -> float:
    """x of the length penalty: the weighted sum of the effort components."""
    return float(sum(w * getattr(self, name) for name, w in weights.items()))


BEHAVIOUR_PENALTIES: dict[str, Callable[[RolloutStats], float]] = {}


def register(name: str):
  """Adds a penalty(stats) -> value in [0, 1] to BEHAVIOUR_PENALTIES under `name`."""
  def decorator(fn: Callable[[RolloutStats], float]):
    if name in BEHAVIOUR_PENALTIES:
      raise ValueError(f"behaviour penalty {name!r} is already registered")
    BEHAVIOUR_PENALTIES[name] = fn
    return fn
  return decorator


@register("malformed_tool_calls")
def malformed_tool_calls(stats: RolloutStats) -> float:
  """Fraction of attempted tool calls that were malformed (the report's 'poor tool calls')."""
  attempted = stats.tool_calls + stats.malformed_tool_calls
  return stats.malformed_tool_calls / attempted if attempted else 0.0


@register("unfinished_todos")
def unfinished_todos(stats: RolloutStats) -> float:
  """Fraction of the to-do items the policy created and left open (the report's example)."""
  if not stats.todo_items_created:
    return 0.0
  return min(1.0, stats.todo_items_open / stats.todo_items_created)


# Phrases of thinking-out-loud that rarely occur in real code comments. A heuristic: it misses
# reasoning in other words and can flag an honest comment; the penalty is weighted accordingly.
_REASONING = re.compile(
    r"\b(let me|let's|i think|i'll|i need to|we need to|wait,|hmm|actually,|on second thought|"
    r"maybe we|but then|so now|okay,? so|the user (wants|asked))", re.IGNORECASE)
_COMMENT = re.compile(r"(?:#|//)\s*(.*)$")


def _comment_lines(code: str) -> list[str]:
  """Text of `#` and `//` comments, one per line (a "#" inside a string literal counts too)."""
  return [m.group(1) for line in code.splitlines() if (m := _COMMENT.search(line))]


@register("thinking_in_comments")
def thinking_in_comments(stats: RolloutStats) -> float:
  """Fraction of written comment lines that read like reasoning (a phrase heuristic)."""
  comments = [c for code in stats.code_written for c in _comment_lines(code)]
  flagged = sum(bool(_REASONING.search(c)) for c in comments)
  return flagged / len(comments) if comments else 0.0


@register("shell_only")
def shell_only(stats: RolloutStats) -> float:
  """1 when files were changed but every call was `run` (the collapse to the terminal tool)."""
  used = set(stats.tool_names_used) - {"finish"}
  return float(stats.files_changed > 0 and used == {"run"})


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """The reward's knobs; `penalty_weights` names entries of BEHAVIOUR_PENALTIES (0 disables)."""

  length: LengthPenaltyConfig = dataclasses.field(default_factory=LengthPenaltyConfig)
  penalty_weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {
      "malformed_tool_calls": 0.1, "unfinished_todos": 0.05, "thinking_in_comments": 0.1,
      "shell_only": 0.1})

  def __post_init__(self):
    for name, weight in self.penalty_weights.items():
      if name not in BEHAVIOUR_PENALTIES:
        raise ValueError(f"penalty_weights: unknown penalty {name!r}; registered: "
                         f"{sorted(BEHAVIOUR_PENALTIES)} (add one with @rewards.register)")
      if not weight >= 0:
        raise ValueError(f"penalty_weights[{name!r}] must be >= 0, got {weight}")


@dataclasses.dataclass(frozen=True)
class RewardBreakdown:
  """total = task - length_penalty - sum(penalties); penalties are weighted, >= 0."""

  total: float
  task: float
  length_penalty: float
  effort: float  # x
  penalties: Mapping[str, float]

  def metrics(self, prefix: str = "reward") -> dict[str, float]:
    """Scalars for the metrics writer: reward/task, reward/length_penalty, reward/penalty/..."""
    out = {f"{prefix}/total": self.total, f"{prefix}/task": self.task,
           f"{prefix}/length_penalty": self.length_penalty, f"{prefix}/effort": self.effort}
    out.update({f"{prefix}/penalty/{name}": value for name, value in self.penalties.items()})
    return out


def total_reward(task_reward: float, stats: RolloutStats, config: RewardConfig
                 ) -> RewardBreakdown:
  """Combines the task reward with the length and behaviour penalties of one rollout."""
  if not math.isfinite(task_reward):
    raise ValueError(f"task reward must be finite, got {task_reward}")
  length_cfg = config.length
  effort = stats.effort(length_cfg.weights)
  length = 0.0
  if length_cfg.coefficient and (length_cfg.apply_to_failed or task_reward > 0):
    length = length_cfg.coefficient * length_penalty(effort, length_cfg.k, length_cfg.q)
  penalties = {name: weight * BEHAVIOUR_PENALTIES[name](stats)
               for name, weight in config.penalty_weights.items()}
  total = task_reward - length - sum(penalties.values())
  return RewardBreakdown(total=total, task=task_reward, length_penalty=length, effort=effort,
                         penalties=penalties)
