"""Loose experiment config in, typed config out, once.

An experiment file's `get_config(arg)` returns an `ml_collections.ConfigDict`; `from_config_dict`
turns it into frozen dataclasses that validate themselves. Every error names the key and the fix,
and happens before anything is compiled. Only the trainer sees `ExperimentConfig`; library
functions receive the plain values they need.

Sections: model (a preset plus field overrides), mesh, data, optim, train, checkpoint, aot.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Mapping, Optional

from c2.model.config import ModelConfig, YarnScaling, get_preset
from c2.parallel import mesh as meshlib
from c2.rl.curriculum import parse_weights as parse_curriculum_weights
from c2.steps import STEPS

PHASES = ("pretrain", "sft", "long_context", "rl")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = 1
  fsdp: int = -1  # -1: all remaining devices
  expert: int = 1
  tensor: int = 1
  context: int = 1
  num_slices: int = 1  # slices over DCN; the data axis spans them (trainer and AOT check alike)

  def axis_sizes(self) -> dict[str, int]:
    return {name: getattr(self, name) for name in meshlib.MESH_AXES}


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = "stdlib"  # c2.data.sources spec: stdlib | jsonl:... | parquet:... | arrayrecord:...
  eval_source: Optional[str] = None  # None: the same source's held-out split
  tokenizer: str = "default"  # default | path/tokenizer.json | path/tiktoken.model
  tokenizer_vocab_size: int = 4096  # for the embedded default tokenizer only
  seq_len: int = 256
  global_batch_size: int = 16
  seed: int = 0
  read_threads: int = 1
  num_workers: int = 0
  text_field: str = "text"
  sft_train_on: str = "current_turn"  # sft only: which assistant turns carry loss
  # Documents shorter than this many tokens are skipped (train and held-out), so long-context
  # rows are filled by single long documents rather than many short ones packed together; 0 keeps
  # every document. Longer documents are still cut into seq_len pieces.
  min_doc_tokens: int = 0
  # Language modelling, train split only: this share of documents becomes a copy drill, random
  # tokens of the document twice, `[BOS] a a [EOS]` within one row (c2/data/examples.py). The
  # second copy is predictable only by looking back, the skill (induction) that copying a path
  # from the prompt into a tool call needs; the tiny model's 240 CPU steps of code lack it.
  repeat_fraction: float = 0.0
  # A copy_drills source (c2/data/copy_drills.py): 0 copies a span of up to half a row right after
  # itself; N > 0 copies spans of up to N tokens anywhere later in the row (far copies). With
  # repeat_fraction, N > 0 copies a span of the document over a later part of it (needles).
  copy_drill_span: int = 0


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  name: str = "adamw"  # adamw | muon (2-D hidden matrices; AdamW for the rest)
  peak_lr: float = 3e-4
  schedule: str = "wsd"  # wsd (warmup-stable-decay) | cosine
  warmup_steps: int = 100
  decay_fraction: float = 0.2  # wsd: final fraction of steps spent decaying
  decay_shape: str = "linear"  # wsd decay: linear | cosine | sqrt
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  muon_momentum: float = 0.95


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000
  max_minutes: Optional[float] = None  # stop (and save) after this much wall time
  log_every: int = 10
  eval_every: int = 200
  eval_batches: int = 8
  seed: int = 0
  ce_chunk_size: int = 2048  # tokens per vocabulary-projection chunk of the loss
  # Project only the tokens the loss weighs (chunks holding none are skipped): faster where most
  # of a row is context (tool-use SFT, RL); gathers over the token axis, so not on a sharded mesh.
  ce_weighted_only: bool = False
  z_loss_weight: float = 0.0
  # Focal CE: each token's CE scaled by (1 - p(target))^focal_gamma, detached (c2/losses/head.py);
  # 0 is plain CE. The metrics stay the plain CE.
  focal_gamma: float = 0.0
  mtp_weight: float = 0.3
  mtp_loss: str = "distill"  # distill (KL to the main head) | ce | distill+ce
  mtp_detach_trunk: bool = True  # the MTP loss trains only the MTP modules
  balance_loss_weight: float = 0.0  # sequence-wise balance loss (DeepSeek-V3 alpha: 1e-4)
  bias_update_rate: float = 1e-3  # aux-loss-free bias speed gamma (0 freezes the bias)
  init_from: Optional[str] = None  # checkpoint dir to load params from (missing MTP: fresh)
  # Also load init_from's optimizer state (moments), continuing pretraining's optimizer in a new
  # phase; the learning-rate schedule restarts at this run's step 0. The checkpoint must be a c2
  # workdir checkpoint of the same model and optimizer.
  init_from_optimizer: bool = False
  nan_check: bool = True
  # c2/evals suites run on the step's params, comma-separated names or groups ("base", "all",
  # "codebase,long_context"); "" runs none. Scalars eval/<suite>/..., figures in workdir/evals.
  eval_suites: str = ""
  eval_suites_every: int = 0  # steps between suite runs (and at the end); 0: train.eval_every
  # Also evaluate (held-out loss and the suites) at step 0 of a fresh run: the start
  # checkpoint's figures on this run's model settings (a new RoPE range), in the same curves.
  eval_at_start: bool = False


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 200
  keep: int = 3
  async_save: bool = True


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The RL phase (c2/rl): rollouts, groups, staleness, the objective, weight publication.
  Rows of the packed batch are data.global_batch_size x data.seq_len tokens."""
  backend: str = "threads"  # threads (in-process) | ray (actors; pip install .[rl])
  env_workers: int = 8  # rollouts in flight
  engines: int = 1  # engine workers (ray backend)
  engine_slots: int = 16  # decode batch per engine
  draft_depth: int = 0  # MTP speculative decoding in rollouts
  prefix_cache: bool = True  # engines reuse the cache of a rollout's previous turn
  decode_steps: int = 4  # decode steps per engine call (c2.infer.Engine(decode_steps=))
  # The engines' compute dtype; "": the model's (model.dtype). On CPU float32 decodes ~2x faster
  # than bfloat16 (XLA:CPU has no fast bf16 dots); the learner keeps model.dtype either way.
  engine_dtype: str = ""
  tasks: str = "generated"  # generated (c2/envs/task_generator.py) | jsonl:PATH (c2/envs/tasks.py)
  task_levels: str = "1"  # generated tasks: comma-separated ladder levels
  train_tasks: int = 4000  # generated tasks of the train split (each used once)
  heldout_tasks: int = 64  # generated tasks of the held-out split (pass-rate evaluation)
  eval_samples: int = 2  # rollouts per held-out task
  eval_every: int = 10  # steps between held-out evaluations (also at the start and the end)
  group_size: int = 8  # rollouts per task (G)
  groups_per_step: int = 4
  max_staleness: int = 1  # versions a token may lag the learner; 0: synchronous
  max_retries: int = 2  # per rollout whose worker died
  # Groups dropped in a row for failed rollouts (none finishing between) that end the run with
  # the last error: a cause that fails every rollout would otherwise burn tasks without end.
  max_failed_groups_in_a_row: int = 8
  temperature: float = 1.0
  top_p: float = 1.0
  max_new_tokens: int = 256  # per turn
  max_context: int = 0  # tokens per rollout context; 0: data.seq_len
  normalizer: float = 0.0  # constant loss normaliser (Dr. GRPO); 0: batch rows x seq_len
  kl_coef: float = 0.0
  kl_placement: str = "reward"  # reward (detached per-token shaping) | loss | none
  is_cap: Optional[float] = None  # truncated importance weights pi_train / pi_sampler
  # Positions where the learner's next-token entropy (nats) is below this get no policy gradient
  # (c2/losses/rl.py, `min_entropy`); 0 trains every sampled token.
  min_token_entropy: float = 0.0
  router_replay: bool = True
  replay_fallback: str = "rank"  # c2.model.router.replay_threshold rule
  publish_dtype: str = "bfloat16"  # weights as the engines get them (float32: trainer numerics)
  snapshot_every: int = 8  # full snapshot every N versions, deltas in between
  attention_weight: float = 1.0  # packing cost of attention relative to tokens
  # Drop a finished group and start another task in its place (c2/rl/coordinator.py): "reward"
  # drops groups whose rewards are all equal (zero advantages), "outcome" also those whose
  # rollouts all passed or all failed (DAPO's dynamic sampling: penalties alone then separate
  # them); "off" trains every group. Uses more tasks: all rl.train_tasks are loaded.
  drop_uniform_groups: str = "off"
  # Draw tasks by their kind's signals after N finished groups (c2/rl/curriculum.py); None: in
  # order. Weights "SIGNAL=W,..." over turns, thinking_tokens, failure (harder kinds, the
  # report's late-training mix) and informative (kinds whose groups' rewards differ).
  curriculum_start_group: Optional[int] = None
  curriculum_weights: str = "turns=1,thinking_tokens=1"
  curriculum_window: int = 64  # unused tasks considered per draw
  curriculum_temperature: float = 1.0
  curriculum_floor: float = 1e-6  # least score a kind is drawn with


@dataclasses.dataclass(frozen=True)
class AotConfig:
  # Default target of `python -m c2.aot` for this experiment (slices: mesh.num_slices).
  topology: str = "v5p:2x2x1"


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  phase: str
  model: ModelConfig
  mesh: MeshConfig
  data: DataConfig
  optim: OptimConfig
  train: TrainConfig
  checkpoint: CheckpointConfig
  aot: AotConfig
  rl: RLConfig = RLConfig()
  env: Optional[dict] = None  # the RL environment's section (c2/envs/config.py), checked there
  name: str = "experiment"

  def validate_for_devices(self, num_devices: int) -> dict[str, int]:
    """Checks the mesh against the devices present and the batch against the data axes."""
    try:
      sizes = meshlib.resolve_axis_sizes(self.mesh.axis_sizes(), num_devices)
    except ValueError as e:
      raise ConfigError(f"config.mesh: {e} ({num_devices} devices present)") from None
    if sizes["data"] % self.mesh.num_slices:
      raise ConfigError(f"config.mesh.data={sizes['data']} must be a multiple of "
                        f"config.mesh.num_slices={self.mesh.num_slices}: the data axis spans the "
                        "slices; set --config.mesh.data to the number of slices (or a multiple)")
    batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if self.data.global_batch_size % batch_shards:
      raise ConfigError(
          f"config.data.global_batch_size={self.data.global_batch_size} is not divisible by the "
          f"batch axes data*fsdp*expert={batch_shards} of mesh {sizes}; use a multiple of "
          f"{batch_shards}")
    if self.data.seq_len % sizes["context"]:
      raise ConfigError(f"config.data.seq_len={self.data.seq_len} is not divisible by "
                        f"mesh context={sizes['context']}")
    return sizes


class ConfigError(ValueError):
  """A bad experiment config; the message names the key and the fix."""


_SECTIONS = {"mesh": MeshConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig,
             "checkpoint": CheckpointConfig, "aot": AotConfig, "rl": RLConfig}


def _unknown_key(key: str, known, prefix: str, what: str = "a known key") -> ConfigError:
  """The error for a key that is not in `known`, with the closest valid key or the list."""
  close = difflib.get_close_matches(key, known, n=1)
  dotted = f"{prefix}." if prefix else ""
  hint = (f"; did you mean {dotted}{close[0]}?" if close else f"; valid keys: {sorted(known)}")
  return ConfigError(f"config.{dotted}{key} is not {what}{hint}")


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
  """Optional[X] -> (X, True); X -> (X, False)."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    return [a for a in typing.get_args(hint) if a is not type(None)][0], True
  return hint, False


def _check_type(key: str, value: Any, annotation: Any) -> Any:
  """Validates (and lightly coerces int->float) one value against a dataclass annotation."""
  hint, optional = _unwrap_optional(annotation)
  if optional and value is None:
    return None
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint in (int, float, str, bool) and not (isinstance(value, hint) and
                                              not (hint is int and isinstance(value, bool))):
    raise ConfigError(f"config.{key}={value!r} must be {hint.__name__}, got {type(value).__name__}")
  return value


def _build(cls, values: Mapping[str, Any], prefix: str):
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  kwargs = {}
  for key, value in values.items():
    if key not in fields:
      raise _unknown_key(key, fields, prefix)
    kwargs[key] = _check_type(f"{prefix}.{key}", value, hints[key])
  try:
    return cls(**kwargs)
  except ValueError as e:
    raise ConfigError(f"config.{prefix}: {e}") from None


def model_section(preset: str, **overrides) -> Any:
  """The `model` section of an experiment: a preset plus every ModelConfig field as an override
  slot (None = the preset's value), so `--config.model.<field>=v` works from the command line."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  section = ml_collections.ConfigDict({"preset": preset})
  hints = typing.get_type_hints(ModelConfig)
  for field in dataclasses.fields(ModelConfig):
    hint, _ = _unwrap_optional(hints[field.name])
    if hint in (int, float, str, bool):
      section[field.name] = ml_collections.FieldReference(overrides.pop(field.name, None),
                                                          field_type=hint)
  if overrides:
    raise ConfigError(f"model_section: unknown or non-scalar ModelConfig fields {sorted(overrides)}")
  return section


def default_config(phase: str, preset: str) -> Any:
  """A complete experiment ConfigDict holding the dataclass defaults, for experiment files to
  start from and change only what differs: the defaults live in one place (the dataclasses)."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  config = ml_collections.ConfigDict({"phase": phase, "name": phase})
  config.model = model_section(preset)
  for name, cls in _SECTIONS.items():
    section = ml_collections.ConfigDict()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
      inner, optional = _unwrap_optional(hints[field.name])
      if optional:  # a typed slot, so None can be overridden from the command line
        section[field.name] = ml_collections.FieldReference(field.default, field_type=inner)
      else:
        section[field.name] = field.default
    config[name] = section
  return config


def _model_config(values: Mapping[str, Any]) -> ModelConfig:
  values = {k: v for k, v in values.items() if v is not None}  # None: keep the preset's value
  preset = values.pop("preset", None)
  if preset is None:
    raise ConfigError("config.model.preset is required (e.g. 'tiny', 'proxy-30b', 'kimi-k2.5')")
  if "rope_scaling" in values and isinstance(values["rope_scaling"], Mapping):
    values["rope_scaling"] = _build(YarnScaling, values["rope_scaling"], "model.rope_scaling")
  base = get_preset(preset)
  hints = typing.get_type_hints(ModelConfig)
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  checked = {}
  for key, value in values.items():
    if key not in fields:
      raise _unknown_key(key, fields, "model", "a ModelConfig field")
    checked[key] = value if key == "rope_scaling" else _check_type(f"model.{key}", value, hints[key])
  try:
    return base.replace(**checked)
  except ValueError as e:
    raise ConfigError(f"config.model: {e}") from None


def from_config_dict(config: Any) -> ExperimentConfig:
  """ConfigDict (or nested dict) -> validated ExperimentConfig."""
  raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  known = {"phase", "name", "model", "env", *_SECTIONS}
  for key in raw:
    if key not in known:
      raise _unknown_key(key, known, "", "a known section")
  phase = raw.get("phase", "pretrain")
  if phase not in PHASES:
    raise ConfigError(f"config.phase={phase!r}; choose one of {PHASES}")
  if phase not in STEPS:
    raise ConfigError(f"config.phase={phase!r} has no train step yet (c2.steps.STEPS has "
                      f"{sorted(STEPS)}); register the phase's step there before running it")
  sections = {name: _build(cls, raw.get(name, {}), name) for name, cls in _SECTIONS.items()}
  env = raw.get("env")
  if env is not None:  # checked now, used by the RL trainer (c2/envs/config.py)
    from c2.envs import config as env_config  # pylint: disable=import-outside-toplevel
    env_config.to_env_config(env)
  exp = ExperimentConfig(phase=phase, model=_model_config(raw.get("model", {})),
                         name=raw.get("name", "experiment"), env=env, **sections)
  _cross_validate(exp)
  return exp


def _cross_validate(exp: ExperimentConfig) -> None:
  model, data, train, optim = exp.model, exp.data, exp.train, exp.optim
  if data.seq_len > model.max_position_embeddings:
    raise ConfigError(
        f"config.data.seq_len={data.seq_len} exceeds the model's RoPE range "
        f"max_position_embeddings={model.max_position_embeddings}; lower seq_len or extend the "
        "range (model.max_position_embeddings with model.rope_scaling)")
  if data.seq_len < 2 or data.global_batch_size < 1:
    raise ConfigError("config.data.seq_len must be >= 2 and global_batch_size >= 1")
  if train.mtp_loss not in ("distill", "ce", "distill+ce"):
    raise ConfigError(f"config.train.mtp_loss={train.mtp_loss!r}; choose distill, ce or distill+ce")
  if optim.name not in ("adamw", "muon"):
    raise ConfigError(f"config.optim.name={optim.name!r}; choose adamw or muon")
  if optim.schedule not in ("wsd", "cosine"):
    raise ConfigError(f"config.optim.schedule={optim.schedule!r}; choose wsd or cosine")
  if optim.decay_shape not in ("linear", "cosine", "sqrt"):
    raise ConfigError(f"config.optim.decay_shape={optim.decay_shape!r}; choose linear, cosine, sqrt")
  if optim.warmup_steps > train.steps:
    raise ConfigError(f"config.optim.warmup_steps={optim.warmup_steps} exceeds config.train.steps="
                      f"{train.steps}")
  if exp.phase == "sft" and "stdlib" in (data.source, data.eval_source):
    raise ConfigError("config.data.source: the sft phase needs a chat JSONL source "
                      "('jsonl:/path/{split}.jsonl' with {'messages': [...]}) or the embedded "
                      "'stdlib_chat', not 'stdlib'")
  if exp.phase != "sft" and "stdlib_chat" in (data.source, data.eval_source):
    raise ConfigError("config.data.source='stdlib_chat' holds chat records for the sft phase; "
                      "use 'stdlib' for language-modelling phases")
  for name in ("log_every", "eval_every", "eval_batches", "steps", "ce_chunk_size"):
    if getattr(train, name) <= 0:
      raise ConfigError(f"config.train.{name} must be positive")
  if train.focal_gamma < 0:
    raise ConfigError(f"config.train.focal_gamma={train.focal_gamma} must be >= 0 (0: plain CE)")
  if train.init_from_optimizer and not train.init_from:
    raise ConfigError("config.train.init_from_optimizer=True needs config.train.init_from (the "
                      "checkpoint whose optimizer state to load)")
  if data.min_doc_tokens < 0:
    raise ConfigError(f"config.data.min_doc_tokens={data.min_doc_tokens} must be >= 0 (0: keep "
                      "every document)")
  if not 0.0 <= data.repeat_fraction <= 1.0:
    raise ConfigError(f"config.data.repeat_fraction={data.repeat_fraction} must be in [0, 1]")
  if data.repeat_fraction and exp.phase in ("sft", "rl"):
    raise ConfigError("config.data.repeat_fraction repeats language-modelling documents; the "
                      f"{exp.phase} phase does not read documents (set it to 0)")
  if data.source.startswith("copy_drills:") and exp.phase in ("sft", "rl"):
    raise ConfigError(f"config.data.source={data.source!r}: copy drills are language-modelling "
                      f"rows; the {exp.phase} phase reads chats (run them as a pretraining "
                      "phase: experiments/pretrain.py:copy_drills)")
  if data.min_doc_tokens and exp.phase in ("sft", "rl"):
    raise ConfigError("config.data.min_doc_tokens filters language-modelling documents; the "
                      f"{exp.phase} phase does not read documents (set it to 0)")
  if train.eval_suites_every < 0:
    raise ConfigError("config.train.eval_suites_every must be >= 0 (0: every train.eval_every)")
  if train.eval_suites:
    from c2.evals import suites  # pylint: disable=import-outside-toplevel
    try:
      suites.parse_suites(train.eval_suites)
    except ValueError as e:
      raise ConfigError(f"config.train.eval_suites={train.eval_suites!r}: {e}") from None
  if exp.checkpoint.every_steps <= 0 or exp.checkpoint.keep <= 0:
    raise ConfigError("config.checkpoint.every_steps and keep must be positive")
  if exp.phase == "rl":
    _validate_rl(exp)
  if math.prod(v for v in exp.mesh.axis_sizes().values() if v > 0) <= 0:
    raise ConfigError("config.mesh: axis sizes must be positive or -1")


def _validate_rl(exp: ExperimentConfig) -> None:
  rl, data = exp.rl, exp.data
  if rl.backend not in ("threads", "ray"):
    raise ConfigError(f"config.rl.backend={rl.backend!r}; choose threads or ray")
  if rl.drop_uniform_groups not in ("off", "reward", "outcome"):
    raise ConfigError(f"config.rl.drop_uniform_groups={rl.drop_uniform_groups!r}; choose off, "
                      "reward or outcome")
  if rl.kl_placement not in ("reward", "loss", "none"):
    raise ConfigError(f"config.rl.kl_placement={rl.kl_placement!r}; choose reward, loss or none")
  if not rl.min_token_entropy >= 0:
    raise ConfigError(f"config.rl.min_token_entropy={rl.min_token_entropy!r}; it is in nats, "
                      ">= 0 (0: every sampled token gets the policy gradient)")
  if rl.publish_dtype not in ("bfloat16", "float32"):
    raise ConfigError(f"config.rl.publish_dtype={rl.publish_dtype!r}; choose bfloat16 or float32")
  if rl.engine_dtype not in ("", "bfloat16", "float32"):
    raise ConfigError(f"config.rl.engine_dtype={rl.engine_dtype!r}; choose bfloat16, float32 or "
                      "'' (the model's compute dtype)")
  try:
    parse_curriculum_weights(rl.curriculum_weights)
  except ValueError as error:
    raise ConfigError(f"config.rl.curriculum_weights: {error}") from None
  if rl.curriculum_window < 1 or not rl.curriculum_temperature > 0 or not rl.curriculum_floor > 0:
    raise ConfigError(f"config.rl.curriculum_window={rl.curriculum_window} must be >= 1, "
                      f"curriculum_temperature={rl.curriculum_temperature} and curriculum_floor="
                      f"{rl.curriculum_floor} > 0")
  if rl.group_size < 2:
    raise ConfigError("config.rl.group_size must be >= 2: advantages are relative to the group")
  if rl.max_staleness < 0 or rl.groups_per_step < 1 or rl.env_workers < 1:
    raise ConfigError("config.rl.max_staleness must be >= 0, groups_per_step and env_workers >= 1")
  if rl.decode_steps < 1:
    raise ConfigError(f"config.rl.decode_steps={rl.decode_steps}: decode steps per engine call "
                      f"must be >= 1 (1: one token per call)")
  if rl.max_context > data.seq_len:
    raise ConfigError(f"config.rl.max_context={rl.max_context} exceeds data.seq_len="
                      f"{data.seq_len}: a rollout context must fit one packed row; raise "
                      "data.seq_len or lower rl.max_context")
  if rl.tasks != "generated" and not rl.tasks.startswith("jsonl:"):
    raise ConfigError(f"config.rl.tasks={rl.tasks!r}; use 'generated' or 'jsonl:/path/tasks.jsonl'")
  try:
    levels = [int(v) for v in rl.task_levels.split(",")]
  except ValueError:
    raise ConfigError(f"config.rl.task_levels={rl.task_levels!r}: comma-separated integers, "
                      "e.g. '1,2'") from None
  if not set(levels) <= {1, 2, 3, 4, 5}:
    raise ConfigError(f"config.rl.task_levels={rl.task_levels!r}: levels are 1..5")
