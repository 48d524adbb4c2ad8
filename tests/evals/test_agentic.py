"""Agentic evaluation: the cost of a rollout, the summary scalars, and (slow) a real run of the
engine and environments."""
import types

import numpy as np
import pytest

from c2.evals import agentic, passk
from c2.model.config import get_preset
from c2.perf import flops
from c2.rl.rollout import Rollout, RolloutSpec, Segment


def _rollout(mask, passed=False, reward_terms=None, **stats):
  n = len(mask)
  segment = Segment(list(range(n)), list(mask), [0.0] * n, [0] * n, None)
  terms = reward_terms or {"reward/total": float(passed), "reward/task": float(passed)}
  return Rollout(RolloutSpec(0, 0, "t", 0), [segment], terms["reward/total"], terms, passed,
                 "finish", {"turns": 1, "tool_calls": 2, "sampled_tokens": sum(mask), **stats})


def _per_token(cfg, position):
  """The FLOPs of feeding the token at `position`: 2 x matmul params + attention over p + 1."""
  counts = flops.param_counts(cfg)
  dense = 2 * (counts.active - counts.embedding - counts.mtp_active)
  return dense + 2 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * cfg.num_layers * (
      position + 1)


def test_rollout_flops_is_prefill_plus_decode_per_turn():
  cfg = get_preset("tiny")
  # prompt 5, reply 3, environment 4, reply 2: turn 1 prefills 0..4 and feeds replies 5, 6;
  # turn 2 prefills 0..11 (the whole context again) and feeds 12.
  mask = [False] * 5 + [True] * 3 + [False] * 4 + [True] * 2
  expected = (sum(_per_token(cfg, p) for p in range(5)) + _per_token(cfg, 5) + _per_token(cfg, 6)
              + sum(_per_token(cfg, p) for p in range(12)) + _per_token(cfg, 12))
  assert agentic.rollout_flops(cfg, _rollout(mask)) == pytest.approx(expected, rel=1e-12)
  assert flops.forward_flops(cfg, 3, 3) == 0
  with pytest.raises(ValueError):
    flops.forward_flops(cfg, 4, 3)


def test_summary_scalars():
  cfg = get_preset("tiny")
  tasks = [types.SimpleNamespace(task_id=f"t{i}", kind="ab"[i // 2]) for i in range(3)]
  outcomes = {"t0": [True, False, False, False], "t1": [True, True, False, True],
              "t2": [False] * 4}
  results = []
  for task in tasks:
    for k, passed in enumerate(outcomes[task.task_id]):
      terms = {"reward/total": float(passed) - 0.1, "reward/task": float(passed),
               "reward/length_penalty": 0.1}
      results.append((task, _rollout([False] * 4 + [True] * (k + 1), passed, terms,
                                     seconds=2.0)))
  results[-1] = (tasks[2], None)  # a rollout that raised: an error and a failure
  out = agentic.summarize(cfg, results, samples=4, wall_seconds=9.0)
  for k in range(1, 5):
    expected = np.mean([passk.pass_at_k(4, sum(v), k) for v in outcomes.values()])
    assert out[f"pass_at_{k}"] == pytest.approx(expected)
  assert out["pass_at_1"] == pytest.approx(4 / 12)
  assert out["pass_rate/a"] == pytest.approx(4 / 8) and out["pass_rate/b"] == 0.0
  assert out["tasks"] == 3 and out["rollouts"] == 12 and out["errors"] == 1
  assert out["reward/task"] == pytest.approx(4 / 11)
  assert out["reward/length_penalty"] == pytest.approx(0.1)
  assert out["sampled_tokens_per_task"] == pytest.approx((10 * 3 - 4) / 11)
  assert out["tool_calls_per_task"] == 2 and out["seconds_per_task"] == 2.0
  assert out["pass_rate_ci_low"] < out["pass_at_1"] < out["pass_rate_ci_high"]
  costs = [agentic.rollout_flops(cfg, r) for _, r in results if r is not None]
  assert out["flops_per_task_median"] == pytest.approx(np.median(costs))
  assert out["truncated_rate"] == 0 and out["no_room_rate"] == 0


def test_prompts_that_fill_the_context_are_counted_and_refused(monkeypatch):
  cfg = get_preset("tiny")
  task = types.SimpleNamespace(task_id="t0", kind=None)  # an external task: no kind tag
  no_room = _rollout([False] * 8, truncated=1)
  cut = _rollout([False] * 4 + [True] * 4, truncated=1)
  out = agentic.summarize(cfg, [(task, no_room), (task, cut)], samples=2, wall_seconds=1.0)
  assert out["truncated_rate"] == 1.0 and out["no_room_rate"] == 0.5
  assert not any(key.startswith("pass_rate/") for key in out)
  monkeypatch.setattr(agentic, "run_rollouts", lambda *a, **k: [(task, no_room)] * 2)
  with pytest.raises(ValueError, match="max_context=8 .*--agentic-context"):
    agentic.evaluate(cfg, None, None, [task], samples=2, env_config=None, sampling=None,
                     max_context=8)


@pytest.mark.slow
def test_real_rollouts_of_a_random_model(small_model, tokenizer):
  from c2.envs import task_generator
  from c2.envs.environment import EnvConfig
  from c2.infer.sampling import SamplingParams
  cfg, params = small_model
  tasks = task_generator.generate(0, 2, split="heldout", levels=(1,))
  out = agentic.evaluate(cfg, params, tokenizer, tasks, samples=2,
                         env_config=EnvConfig(tool_declaration="none", max_turns=2),
                         sampling=SamplingParams(max_new_tokens=8), max_context=1024, slots=4)
  assert out["rollouts"] == 4 and out["errors"] == 0
  assert out["pass_at_1"] == 0.0 and out["pass_at_2"] == 0.0  # a random model solves nothing
  assert 1 <= out["turns_per_task"] <= 2 and out["sampled_tokens_per_task"] >= 1
  assert out["flops_per_task_median"] > flops.forward_flops(cfg, 0, 100)
  assert "reward/task" in out and out["wall_seconds"] > 0
