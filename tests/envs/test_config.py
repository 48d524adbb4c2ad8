"""The env section of an experiment config: round trip, command-line overrides, clear errors."""
import pytest

from c2.config import ConfigError
from c2.envs import config as env_config_lib
from c2.envs.environment import EnvConfig


def test_defaults_round_trip_to_the_dataclass_defaults():
  assert env_config_lib.to_env_config(env_config_lib.env_section()) == EnvConfig()


def test_overrides_reach_every_level():
  section = env_config_lib.env_section()
  section.max_turns = 7
  section.tools.enabled = "read_file, edit_file, finish"
  section.sandbox.wall_seconds = 3.0
  section.summary.trigger_tokens = 4000
  section.reward.length.q = 1.5
  section.reward.length.weights.turns = 0.0
  section.reward.penalty_weights.shell_only = 0.0
  cfg = env_config_lib.to_env_config(section)
  assert cfg.max_turns == 7 and cfg.tools.enabled == ("read_file", "edit_file", "finish")
  assert cfg.tools.run_limits.wall_seconds == 3.0 and cfg.summary.trigger_tokens == 4000
  assert cfg.reward.length.q == 1.5 and cfg.reward.length.weights["turns"] == 0.0
  assert cfg.reward.penalty_weights["shell_only"] == 0.0


@pytest.mark.parametrize("path, value, message", [
    (("max_turn",), 3, "config.env.max_turn is not a known key"),
    (("sandbox", "isolation"), "docker", "config.env.sandbox"),
    (("tools", "enabled"), "read_file", "must include 'finish'"),
    (("reward", "length", "k"), -1.0, "k > 0"),
    (("reward", "penalty_weights", "typo"), 1.0, "unknown penalty 'typo'"),
])
def test_bad_values_name_the_key(path, value, message):
  values = env_config_lib.env_section().to_dict()
  node = values
  for key in path[:-1]:
    node = node[key]
  node[path[-1]] = value
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    env_config_lib.to_env_config(values)
