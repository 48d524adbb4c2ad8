"""What the RL learner logs about its samples and its held-out pass rate, as plain scalars.

  rollout_metrics(groups, step)     rewards (mean and per component), pass rate, lengths, turns,
                                    tool calls, summaries, staleness of the step's groups
  sampled_metrics(log)              pass rate and reward of all rollouts finished since the last
                                    step, trained or dropped
  pass_rate(results)                held-out pass rate with a 95% confidence interval
  pass_rate_by_kind(results)        held-out pass rate per task kind (Task.kind)
  per_task_pass_rates(results)      task id -> fraction of its rollouts that passed
  pass_rate_change(start, end)      paired change of the pass rate over the same tasks, 95% CI
  train_sequences(groups)           the groups as c2.rl.packing.TrainSequence, with advantages

The interval treats tasks as the unit of sampling (rollouts of one task are correlated): the mean
of the per-task pass rates, +- 1.96 standard errors of those means (t-free; fine from ~30 tasks),
clipped to [0, 1]. A change between two evaluations of the same tasks is judged paired, task by
task: the shared difficulty of a task cancels, so the interval of the change is narrower than the
two intervals side by side suggest.
"""
from __future__ import annotations

import collections
import math
from typing import Iterable, Optional, Sequence

import numpy as np

from c2.losses import policy_gradient as pg
from c2.rl.packing import TrainSequence

_STATS = {"turns": "turns", "tool_calls": "tool_calls", "summaries": "summaries",
          "sampled_tokens": "sampled_tokens", "context_tokens": "context_tokens",
          "thinking_tokens": "thinking_tokens", "malformed_tool_calls": "malformed_tool_calls",
          "truncated": "truncated", "seconds": "seconds"}


def rollout_metrics(groups: Sequence, step: int) -> dict[str, float]:
  rollouts = [r for g in groups for r in g.rollouts]
  if not rollouts:
    return {}
  out: dict[str, float] = {}
  terms = collections.defaultdict(list)
  for r in rollouts:
    for name, value in r.reward_terms.items():
      terms[name].append(value)
  out.update({name: float(np.mean(values)) for name, values in terms.items()})
  out["reward/mean"] = float(np.mean([r.reward for r in rollouts]))
  out["rollout/pass_rate"] = float(np.mean([r.passed for r in rollouts]))
  for key, name in _STATS.items():
    out[f"rollout/{name}_mean"] = float(np.mean([r.stats.get(key, 0) for r in rollouts]))
  out["rollout/sampled_tokens_max"] = float(max(r.stats.get("sampled_tokens", 0) for r in rollouts))
  staleness = [step - r.min_version for r in rollouts if r.min_version >= 0]
  if staleness:
    out["rl/staleness_mean"] = float(np.mean(staleness))
    out["rl/staleness_max"] = float(max(staleness))
  # Groups whose rollouts all got the same reward carry no gradient under A = R - mean(R).
  out["rl/groups_all_equal"] = float(np.mean([np.ptp(g.rewards) == 0 for g in groups]))
  return out


def sampled_metrics(log: Sequence[dict]) -> dict[str, float]:
  """Pass rate and reward of every rollout finished since the last step (Coordinator.
  drain_rollout_log), trained or not: with uniform groups dropped, the trained groups' own pass
  rate (rollout/pass_rate) is biased toward the tasks that split, so read the policy's from here."""
  if not log:
    return {}
  return {"sampled/pass_rate": float(np.mean([r["passed"] for r in log])),
          "sampled/reward_mean": float(np.mean([r["reward"] for r in log])),
          "sampled/rollouts": float(len(log))}


def _mean_and_half_width(values: np.ndarray) -> tuple[float, float]:
  n = len(values)
  half = 1.96 * float(values.std(ddof=1)) / math.sqrt(n) if n > 1 else float("nan")
  return float(values.mean()), half


def per_task_pass_rates(results: Iterable[tuple[str, bool]]) -> dict[str, float]:
  by_task = collections.defaultdict(list)
  for task_id, passed in results:
    by_task[task_id].append(float(passed))
  return {task_id: float(np.mean(v)) for task_id, v in by_task.items()}


def pass_rate(results: Iterable[tuple[str, bool]]) -> dict[str, float]:
  """(task_id, passed) per rollout -> mean, 95% CI (over tasks), counts."""
  results = list(results)
  means = np.array(list(per_task_pass_rates(results).values()))
  if len(means) == 0:
    return {}
  mean, half = _mean_and_half_width(means)
  return {"pass_rate": mean, "pass_rate_ci_low": max(0.0, mean - half),
          "pass_rate_ci_high": min(1.0, mean + half), "tasks": float(len(means)),
          "rollouts": float(len(results))}


def pass_rate_by_kind(results: Iterable[tuple[Optional[str], bool]]) -> dict[str, float]:
  """(Task.kind, passed) per rollout -> {"pass_rate/<kind>": mean} over the rollouts of each task
  kind (tasks without a kind are left out). A mean over kinds hides which skill is missing: the
  tiny SFT policies pass set_constant tasks or none, and no rename_symbol task."""
  by_kind = collections.defaultdict(list)
  for kind, passed in results:
    if kind is not None:
      by_kind[kind].append(bool(passed))
  return {f"pass_rate/{kind}": float(np.mean(v)) for kind, v in sorted(by_kind.items())}


def pass_rate_change(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
  """Per-task pass rates at two evaluations -> the mean change over their shared tasks and its
  paired 95% CI. A rise is beyond noise when pass_rate_change_ci_low > 0."""
  shared = sorted(set(start) & set(end))
  if not shared:
    return {}
  change, half = _mean_and_half_width(np.array([end[t] - start[t] for t in shared]))
  return {"pass_rate_change": change, "pass_rate_change_ci_low": change - half,
          "pass_rate_change_ci_high": change + half}


def train_sequences(groups: Sequence) -> list[TrainSequence]:
  """Every segment of every rollout, with its chain's group-relative advantage (Dr. GRPO: no
  division by the group's std, no length normalisation; c2/losses/policy_gradient.py)."""
  rewards = np.concatenate([g.rewards for g in groups])
  group_ids = np.concatenate([np.full(len(g.rollouts), g.group_id) for g in groups])
  advantages = np.asarray(pg.group_advantages(rewards, group_ids))
  sequences, k = [], 0
  for group in groups:
    for rollout in group.rollouts:
      for segment in rollout.segments:
        sequences.append(TrainSequence(
            tokens=np.asarray(segment.tokens, np.int32),
            loss_mask=np.asarray(segment.model_mask, np.float32),
            sampler_logp=np.asarray(segment.sampler_logp, np.float32),
            advantage=float(advantages[k]), routes=segment.routes, group=group.group_id))
      k += 1
  return sequences
