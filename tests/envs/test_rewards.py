"""Rewards: the nonlinear length penalty's limits and shape, behaviour penalties, the total."""
import math

import numpy as np
import pytest

from c2.envs import rewards

KS = (1e-4, 1e-3, 1e-2, 1.0)
QS = (0.0, 0.1, 0.5, 0.9, 1.0, 1.1, 1.5, 2.0, 3.0)
XS = np.concatenate([[0.0], np.geomspace(1e-3, 1e6, 200)])


@pytest.mark.parametrize("k", KS)
def test_q_to_zero_is_linear(k):
  np.testing.assert_allclose(rewards.length_penalty(XS, k, 1e-9), XS, rtol=1e-6, atol=1e-12)
  np.testing.assert_allclose(rewards.length_penalty(XS, k, 0.0), XS, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", KS)
def test_q_one_is_log_and_continuous(k):
  log = np.log1p(k * XS) / k
  np.testing.assert_allclose(rewards.length_penalty(XS, k, 1.0), log, rtol=1e-14)
  for q in (1 - 1e-7, 1 + 1e-7, 1 - 1e-13, 1 + 1e-13):
    np.testing.assert_allclose(rewards.length_penalty(XS, k, q), log, rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("q", (1.5, 2.0, 3.0))
def test_q_above_one_is_bounded_and_approaches_the_bound(k, q):
  bound = 1 / (k * (q - 1))
  assert np.all(rewards.length_penalty(XS, k, q) < bound)
  huge = 1e14 / k  # (1 + k x)^(1 - q) <= 1e-7: within that of the bound
  assert rewards.length_penalty(huge, k, q) == pytest.approx(bound, rel=1e-6)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("q", QS)
def test_increasing_and_concave(k, q):
  x = np.linspace(0.0, 50.0 / k, 2001)  # from x = 0 to well past the bend at x ~ 1/k
  c = rewards.length_penalty(x, k, q)
  assert c[0] == 0.0
  assert np.all(np.diff(c) > 0)
  second = np.diff(c, 2)
  # Linear at q = 0: second differences are rounding noise around 0.
  assert np.all(second <= 1e-9 * np.abs(c).max())
  if q >= 0.5:
    assert second[0] < 0  # strictly concave where the curvature is large enough to measure


def test_slope_one_at_zero_and_report_examples():
  assert rewards.length_penalty(1e-6, 1e-3, 1.5) == pytest.approx(1e-6, rel=1e-6)
  # Example values from the research notes (section 4.8), k = 1e-3.
  for q, expected in ((0.5, (828, 4633, 18100)), (1.0, (693, 2398, 4615)),
                      (1.5, (586, 1397, 1801))):
    got = [rewards.length_penalty(x, 1e-3, q) for x in (1e3, 1e4, 1e5)]
    np.testing.assert_allclose(got, expected, rtol=1e-3)


def test_scalar_and_array_types_and_errors():
  assert isinstance(rewards.length_penalty(10, 0.1, 0.5), float)
  out = rewards.length_penalty(np.ones((2, 3)), 0.1, 0.5)
  assert isinstance(out, np.ndarray) and out.shape == (2, 3)
  for bad in (dict(x=-1.0, k=1.0, q=1.0), dict(x=1.0, k=0.0, q=1.0),
              dict(x=math.inf, k=1.0, q=1.0), dict(x=1.0, k=1.0, q=-0.5)):
    with pytest.raises(ValueError):
      rewards.length_penalty(**bad)


def test_effort_and_config_validation():
  stats = rewards.RolloutStats(thinking_tokens=100, tool_call_tokens=20, tool_output_tokens=500,
                               final_message_tokens=10, tool_calls=3, turns=2)
  weights = {"thinking_tokens": 1.0, "tool_output_tokens": 0.1, "turns": 50.0}
  assert stats.effort(weights) == pytest.approx(100 + 50 + 100)
  with pytest.raises(ValueError, match="weights"):
    rewards.LengthPenaltyConfig(weights={"thinking": 1.0})
  with pytest.raises(ValueError, match="k > 0"):
    rewards.LengthPenaltyConfig(k=0.0)
  with pytest.raises(ValueError, match="unknown penalty 'typo'"):
    rewards.RewardConfig(penalty_weights={"typo": 1.0})


def test_behaviour_penalties():
  get = rewards.BEHAVIOUR_PENALTIES
  assert set(get) >= {"malformed_tool_calls", "unfinished_todos", "thinking_in_comments",
                      "shell_only"}
  assert get["malformed_tool_calls"](rewards.RolloutStats(tool_calls=3, malformed_tool_calls=1)) \
      == 0.25
  assert get["malformed_tool_calls"](rewards.RolloutStats()) == 0.0
  assert get["unfinished_todos"](rewards.RolloutStats(todo_items_created=4, todo_items_open=1)) \
      == 0.25
  reasoning = "x = 1  # Let me think: we need to handle the empty case first\n"
  plain = ("# Cache the parsed config so repeated calls stay cheap.\n"
           "y = 2  // bounds checked above\n")
  assert get["thinking_in_comments"](rewards.RolloutStats(code_written=(plain,))) == 0.0
  assert get["thinking_in_comments"](
      rewards.RolloutStats(code_written=(plain, reasoning, "# Hmm, wait, actually no\n"))) == 0.5
  shell = rewards.RolloutStats(tool_names_used=("run", "run", "finish"), files_changed=1)
  assert get["shell_only"](shell) == 1.0
  assert get["shell_only"](rewards.RolloutStats(tool_names_used=("run", "edit_file"),
                                                files_changed=1)) == 0.0
  assert get["shell_only"](rewards.RolloutStats(tool_names_used=("run",), files_changed=0)) == 0.0


def test_register_custom_penalty():
  @rewards.register("test_long_final_message")
  def long_final_message(stats):
    return float(len(stats.final_message) > 10)

  try:
    with pytest.raises(ValueError, match="already registered"):
      rewards.register("test_long_final_message")(long_final_message)
    config = rewards.RewardConfig(penalty_weights={"test_long_final_message": 0.5})
    out = rewards.total_reward(1.0, rewards.RolloutStats(final_message="x" * 20), config)
    assert out.penalties == {"test_long_final_message": 0.5}
  finally:
    del rewards.BEHAVIOUR_PENALTIES["test_long_final_message"]


def test_total_reward_components_and_metrics():
  config = rewards.RewardConfig(
      length=rewards.LengthPenaltyConfig(coefficient=1e-4, k=1e-3, q=1.0),
      penalty_weights={"malformed_tool_calls": 0.2, "shell_only": 0.1})
  stats = rewards.RolloutStats(thinking_tokens=1000, tool_calls=3, malformed_tool_calls=1,
                               turns=4, tool_names_used=("read_file", "edit_file", "finish"),
                               files_changed=1)
  out = rewards.total_reward(0.75, stats, config)
  x = stats.effort(config.length.weights)
  assert out.effort == x
  assert out.length_penalty == pytest.approx(1e-4 * math.log1p(1e-3 * x) / 1e-3)
  assert out.penalties == {"malformed_tool_calls": pytest.approx(0.05), "shell_only": 0.0}
  assert out.total == pytest.approx(0.75 - out.length_penalty - 0.05)
  metrics = out.metrics()
  assert set(metrics) == {"reward/total", "reward/task", "reward/length_penalty", "reward/effort",
                          "reward/penalty/malformed_tool_calls", "reward/penalty/shell_only"}
  assert metrics["reward/task"] == 0.75

  exempt = rewards.RewardConfig(length=rewards.LengthPenaltyConfig(apply_to_failed=False))
  assert rewards.total_reward(0.0, stats, exempt).length_penalty == 0.0
  assert rewards.total_reward(1.0, stats, exempt).length_penalty > 0.0
  off = rewards.RewardConfig(length=rewards.LengthPenaltyConfig(coefficient=0.0),
                             penalty_weights={})
  assert rewards.total_reward(1.0, stats, off).total == 1.0
