"""What the RL learner logs about its samples and its held-out pass rate, as plain scalars.

  rollout_metrics(groups, step)     rewards (mean and per component), pass rate, lengths, turns,
                                    tool calls, summaries, staleness of the step's groups
  pass_rate(results)                held-out pass rate with a 95% confidence interval
  train_sequences(groups)           the groups as c2.rl.packing.TrainSequence, with advantages

The interval treats tasks as the unit of sampling (rollouts of one task are correlated): the mean
of the per-task pass rates, +- 1.96 standard errors of those means (t-free; fine from ~30 tasks).
"""
from __future__ import annotations

import collections
import math
from typing import Iterable, Sequence

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


def pass_rate(results: Iterable[tuple[str, bool]]) -> dict[str, float]:
  """(task_id, passed) per rollout -> mean, 95% CI (over tasks), counts."""
  by_task = collections.defaultdict(list)
  for task_id, passed in results:
    by_task[task_id].append(float(passed))
  means = np.array([np.mean(v) for v in by_task.values()])
  n = len(means)
  if n == 0:
    return {}
  mean = float(means.mean())
  half = 1.96 * float(means.std(ddof=1)) / math.sqrt(n) if n > 1 else float("nan")
  return {"pass_rate": mean, "pass_rate_ci_low": mean - half, "pass_rate_ci_high": mean + half,
          "tasks": float(n), "rollouts": float(sum(len(v) for v in by_task.values()))}


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
