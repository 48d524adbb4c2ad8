"""The environment's section of an experiment config: ml_collections in, a checked EnvConfig out.

    c.env = env_section()                       # in an experiment file's get_config
    --config.env.reward.length.q=1.5            # from the command line
    env_config = to_env_config(c.env)           # at the root (the RL trainer), once

Every knob the report tunes per environment is here: the tool set and its limits, the sandbox,
turns, self-summarization, the length penalty C(x) = ((1 + kx)^(1-q) - 1) / (k(1-q)) with its
coefficient and the weights of x, and the behaviour penalties' weights. Unknown keys and bad
values raise a ConfigError naming `config.env.<key>` and the fix.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from c2.config import ConfigError
from c2.envs import rewards, sandbox
from c2.envs.environment import EnvConfig, SummaryConfig
from c2.envs.tools import ToolConfig

_TOP = ("max_turns", "max_calls_per_turn", "parallel_read_calls", "system_prompt", "thinking",
        "grading_mode", "tool_declaration")
_TOOLS = ("enabled", "max_read_lines", "max_tool_output_chars", "max_grep_matches",
          "max_write_bytes", "strict_arguments")
_SANDBOX = ("cpu_seconds", "wall_seconds", "memory_bytes", "max_processes", "max_open_files",
            "max_file_bytes", "max_output_bytes", "workspace_bytes", "workspace_files",
            "tmp_bytes", "isolation", "require_isolation")
_SUMMARY = ("trigger_tokens", "max_summaries", "request", "carry_todos", "carry_count")
_LENGTH = ("coefficient", "k", "q", "apply_to_failed")


def _fields(instance, names) -> dict:
  return {name: getattr(instance, name) for name in names}


def env_section(config: EnvConfig = EnvConfig()) -> Any:
  """A ConfigDict holding every field of `config` (default: the defaults)."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  tools, limits = config.tools, config.tools.run_limits
  length = config.reward.length
  section = ml_collections.ConfigDict({
      **_fields(config, _TOP),
      "tools": {**_fields(tools, _TOOLS), "enabled": ",".join(tools.enabled)},
      "sandbox": _fields(limits, _SANDBOX),
      "summary": _fields(config.summary, _SUMMARY),
      "reward": {"length": {**_fields(length, _LENGTH), "weights": dict(length.weights)},
                 "penalty_weights": dict(config.reward.penalty_weights)},
  })
  # trigger_tokens defaults to None; give it a type so the command line can set an int.
  section.summary.trigger_tokens = ml_collections.FieldReference(
      config.summary.trigger_tokens, field_type=int)
  return section


def _take(values: Mapping[str, Any], names, prefix: str) -> dict:
  unknown = sorted(set(values) - set(names))
  if unknown:
    raise ConfigError(f"config.{prefix}.{unknown[0]} is not a known key; valid keys: "
                      f"{sorted(names)}")
  return {name: values[name] for name in names if name in values}


def _build(cls, kwargs: dict, prefix: str):
  hints = {f.name: f.type for f in dataclasses.fields(cls)}
  for key, value in kwargs.items():
    default = getattr(cls(), key) if key in hints and cls is not EnvConfig else None
    if isinstance(default, (int, float)) and isinstance(value, bool) != isinstance(default, bool):
      raise ConfigError(f"config.{prefix}.{key}={value!r} must be {type(default).__name__}")
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.{prefix}: {e}") from None


def to_env_config(section: Any, prefix: str = "env") -> EnvConfig:
  """ConfigDict (or plain nested dict) -> EnvConfig, checked."""
  values = section.to_dict() if hasattr(section, "to_dict") else dict(section)
  nested = ("tools", "sandbox", "summary", "reward")
  top = _take({k: v for k, v in values.items() if k not in nested}, _TOP, prefix)
  tools = _take(values.get("tools", {}), _TOOLS, f"{prefix}.tools")
  if isinstance(tools.get("enabled"), str):
    tools["enabled"] = tuple(name.strip() for name in tools["enabled"].split(",") if name.strip())
  limits = _build(sandbox.SandboxLimits, _take(values.get("sandbox", {}), _SANDBOX,
                                               f"{prefix}.sandbox"), f"{prefix}.sandbox")
  reward_values = values.get("reward", {})
  _take(reward_values, ("length", "penalty_weights"), f"{prefix}.reward")
  length_values = dict(reward_values.get("length", {}))
  weights = length_values.pop("weights", None)
  length = _take(length_values, _LENGTH, f"{prefix}.reward.length")
  if weights is not None:
    length["weights"] = dict(weights)
  reward = _build(rewards.RewardConfig, {
      "length": _build(rewards.LengthPenaltyConfig, length, f"{prefix}.reward.length"),
      **({"penalty_weights": dict(reward_values["penalty_weights"])}
         if "penalty_weights" in reward_values else {})}, f"{prefix}.reward")
  return _build(EnvConfig, {
      **top,
      "tools": _build(ToolConfig, {**tools, "run_limits": limits}, f"{prefix}.tools"),
      "summary": _build(SummaryConfig, _take(values.get("summary", {}), _SUMMARY,
                                             f"{prefix}.summary"), f"{prefix}.summary"),
      "reward": reward}, prefix)
