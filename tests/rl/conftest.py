"""A tiny RL world for the tests: a small model's params in a weight store, the 512-id tokenizer,
level-1 tasks, and the WorkerSpec the backends build their workers from."""
import dataclasses

import jax
import pytest

from c2.envs import task_generator
from c2.envs.environment import EnvConfig
from c2.envs.tools import ToolConfig
from c2.infer.sampling import SamplingParams
from c2.rl import publication
from c2.rl.workers import WorkerSpec

RL_TOOLS = ("read_file", "edit_file", "finish")


@dataclasses.dataclass
class RLWorld:
  cfg: object
  params: dict
  store_dir: str
  tokenizer_path: str
  spec: WorkerSpec
  tasks: list


@pytest.fixture(scope="session")
def small_model(small_cfg):
  """The `small_cfg` model as experiment overrides: every field where it differs from tiny."""
  from c2.model.config import get_preset
  tiny = get_preset("tiny")
  return {f.name: getattr(small_cfg, f.name) for f in dataclasses.fields(small_cfg)
          if getattr(small_cfg, f.name) != getattr(tiny, f.name) and f.name != "rope_scaling"}


@pytest.fixture(scope="session")
def rl_world(small_cfg, tokenizer_512, tmp_path_factory):
  """Random (untrained) small-model weights as version 0; sampling is cut short (24 new tokens,
  3 turns) so a rollout costs a few engine steps."""
  from c2 import model
  cfg = small_cfg.replace(mtp_depth=1)
  params = jax.device_get(model.init_params(cfg, jax.random.key(0)))
  store_dir = str(tmp_path_factory.mktemp("weights"))
  publication.WeightStore(store_dir, dtype="float32").publish(0, params)
  env = EnvConfig(tools=ToolConfig(enabled=RL_TOOLS), max_turns=3)
  spec = WorkerSpec(model=cfg, store_dir=store_dir, tokenizer_path=str(tokenizer_512), env=env,
                    sampling=SamplingParams(max_new_tokens=24, temperature=1.0),
                    max_context=1024, engine_slots=4, prefill_chunk=256)
  tasks = task_generator.generate(0, 4, split="train", levels=(1,))
  return RLWorld(cfg, params, store_dir, str(tokenizer_512), spec, tasks)
