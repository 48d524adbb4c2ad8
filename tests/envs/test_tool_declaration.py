"""How the prompt declares the tools: full schemas, compact ones, or none (tools still enabled)."""
import json

import pytest

from c2.envs import task_generator
from c2.envs.environment import CodingEnv, EnvConfig
from c2.envs.policies import OraclePolicy, run_episode
from c2.envs.tools import ToolConfig

TOOLS = ToolConfig(enabled=("read_file", "edit_file", "finish"))


@pytest.fixture(scope="module")
def task():
  return task_generator.generate(0, 1, split="train", levels=(1,))[0]


def test_compact_schemas_keep_names_and_arguments_without_descriptions(task):
  full = CodingEnv(task, EnvConfig(tools=TOOLS)).tool_schemas()
  compact = CodingEnv(task, EnvConfig(tools=TOOLS, tool_declaration="compact")).tool_schemas()
  assert [s["function"]["name"] for s in compact] == ["read_file", "edit_file", "finish"]
  assert "description" in json.dumps(full) and "description" not in json.dumps(compact)
  for f, c in zip(full, compact):
    assert (c["function"]["parameters"]["required"] == f["function"]["parameters"]["required"])
    assert (set(c["function"]["parameters"]["properties"]) ==
            set(f["function"]["parameters"]["properties"]))
  assert len(json.dumps(compact)) < 0.75 * len(json.dumps(full))  # measured: 624 vs 894 chars


def test_no_declaration_still_runs_the_tools(task):
  env = CodingEnv(task, EnvConfig(tools=TOOLS, tool_declaration="none"))
  assert env.tool_schemas() == []
  assert run_episode(env, OraclePolicy(task)).reward.task == 1.0


def test_unknown_declaration_is_refused(task):
  with pytest.raises(ValueError, match="tool_declaration='short'"):
    CodingEnv(task, EnvConfig(tools=TOOLS, tool_declaration="short")).tool_schemas()
