"""The evaluation suites by name, and the one function that runs a list of them on a checkpoint.

    scalars = run_suites(["codebase", "state_tracking"], cfg, params, tokenizer, SuiteOptions())
    scalars["eval/codebase/nats_per_byte"], scalars["eval/state_tracking/char_distance"], ...

Suites (names for `--suite` and `train.eval_suites`; `base` = the three base-model probes, `all`):
  codebase        total nats of the held-out corpus over a rolling window, nats per byte
                  (codebase_loss.py)
  state_tracking  reconstruct a file after a chain of diffs: mean character distance
                  (state_tracking.py)
  knowledge       question/answer pairs, exact match and answer nats (knowledge.py; your own JSONL)
  long_context    loss by position, needle and variable tracking by length (long_context.py)
  ruler           RULER-style single- and multi-key needles and variable-tracking chains by
                  length: exact match, answer nats, nats the needle is worth (ruler.py)
  agentic         held-out environment tasks: pass@k, rewards, tokens, tool calls, cost (agentic.py)
Every scalar is named eval/<suite>/<metric>, plus eval/<suite>/seconds (wall time of the suite),
so the train loop logs them with its metric writer. SuiteOptions holds plain values; the roots
(c2/eval.py, c2/train/loop.py) fill it from their command line or config.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

from c2.data.tokenizer import Tokenizer
from c2.envs import task_generator
from c2.envs.environment import EnvConfig
from c2.envs.tasks import read_jsonl
from c2.evals import agentic, codebase_loss, knowledge, long_context, ruler, state_tracking
from c2.evals.probe_model import ProbeModel
from c2.infer.sampling import SamplingParams
from c2.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class SuiteOptions:
  context: int = 256  # probe row length and rolling window (the model's trained context)
  stride: int = 0  # rolling-window stride; 0: context // 2
  batch: int = 8  # rows per forward
  seed: int = 0
  codebase_bytes: int = 0  # of the held-out corpus from its start (files sorted by path); 0: all
  state_examples: int = 48
  state_lines: int = 5
  state_diffs: int = 2
  knowledge_path: Optional[str] = None  # JSONL {"question", "answer"}; None: the builtin pairs
  knowledge_questions: int = 64
  long_lengths: tuple[int, ...] = ()  # (): context / 4, / 2, x 1, x 2
  long_examples: int = 8  # per kind and length (long_context and ruler)
  long_rows: int = 16  # rows of the loss-by-position curve
  agentic_tasks: str = "generated"  # generated | jsonl:PATH (held-out tasks)
  agentic_count: int = 16
  agentic_levels: tuple[int, ...] = (1,)
  agentic_samples: int = 4  # per task: pass@k for k = 1..samples
  agentic_max_new_tokens: int = 160  # per turn
  agentic_max_context: int = 0  # tokens per rollout; 0: context
  agentic_temperature: float = 1.0
  env: EnvConfig = EnvConfig()

  def lengths(self, max_positions: int) -> tuple[int, ...]:
    lengths = self.long_lengths or (self.context // 4, self.context // 2, self.context,
                                    2 * self.context)
    return tuple(sorted({l for l in lengths if 8 <= l <= max_positions}))


def _codebase(probe: ProbeModel, o: SuiteOptions) -> dict:
  text = codebase_loss.stdlib_text(max_bytes=o.codebase_bytes or None)
  return codebase_loss.codebase_loss(text, probe.tokenizer.encode, probe.logprobs,
                                     window=o.context, stride=o.stride or o.context // 2,
                                     bos_id=probe.tokenizer.bos_id)


def _state_tracking(probe: ProbeModel, o: SuiteOptions) -> dict:
  examples = state_tracking.build_examples(o.state_examples, num_lines=o.state_lines,
                                           num_diffs=o.state_diffs, seed=o.seed)
  return state_tracking.evaluate(probe, examples)


def _knowledge(probe: ProbeModel, o: SuiteOptions) -> dict:
  pairs = (knowledge.read_pairs(o.knowledge_path) if o.knowledge_path
           else knowledge.builtin_pairs(o.knowledge_questions, o.seed))
  return knowledge.evaluate(probe, pairs)


def _long_context(probe: ProbeModel, o: SuiteOptions) -> dict:
  return long_context.evaluate(probe, lengths=o.lengths(probe.cfg.max_position_embeddings),
                               examples=o.long_examples, position_rows=o.long_rows, seed=o.seed)


def _ruler(probe: ProbeModel, o: SuiteOptions) -> dict:
  return ruler.evaluate(probe, lengths=o.lengths(probe.cfg.max_position_embeddings),
                        examples=o.long_examples, seed=o.seed)


def heldout_tasks(o: SuiteOptions) -> list:
  if o.agentic_tasks.startswith("jsonl:"):
    return read_jsonl(o.agentic_tasks[len("jsonl:"):].format(split="heldout"))[:o.agentic_count]
  return task_generator.generate(o.seed, o.agentic_count, split="heldout",
                                 levels=o.agentic_levels)


def _agentic(probe: ProbeModel, o: SuiteOptions) -> dict:
  sampling = SamplingParams(max_new_tokens=o.agentic_max_new_tokens,
                            temperature=o.agentic_temperature)
  return agentic.evaluate(probe.cfg, probe.params, probe.tokenizer, heldout_tasks(o),
                          samples=o.agentic_samples, env_config=o.env, sampling=sampling,
                          max_context=o.agentic_max_context or o.context, slots=o.batch)


SUITES: dict[str, Callable[[ProbeModel, SuiteOptions], dict]] = {
    "codebase": _codebase, "state_tracking": _state_tracking, "knowledge": _knowledge,
    "long_context": _long_context, "ruler": _ruler, "agentic": _agentic}
GROUPS = {"base": ("codebase", "state_tracking", "knowledge"), "all": tuple(SUITES)}


def parse_suites(spec: str) -> list[str]:
  """"a,b" (names or groups) -> suite names in order, duplicates dropped; ValueError names an
  unknown one and the choices."""
  names = []
  for part in (p.strip() for p in spec.split(",")):
    if not part:
      continue
    if part not in SUITES and part not in GROUPS:
      raise ValueError(f"unknown eval suite {part!r}; choose from {sorted(SUITES)} or the groups "
                       f"{sorted(GROUPS)}")
    names += [n for n in GROUPS.get(part, (part,)) if n not in names]
  return names


def probe_capacity(names: Sequence[str], cfg: ModelConfig, o: SuiteOptions) -> int:
  """Engine tokens per sequence the suites need (long-context prompts can exceed `context`)."""
  capacity = o.context
  if "long_context" in names or "ruler" in names:
    capacity = max(capacity, max(o.lengths(cfg.max_position_embeddings), default=0) + 8)
  return capacity


def run_suites(names: Sequence[str], cfg: ModelConfig, params, tokenizer: Tokenizer,
               options: SuiteOptions, log: Callable[[str], None] = lambda _: None
               ) -> dict[str, float]:
  """Runs the named suites on one set of params; flat eval/<suite>/<metric> scalars."""
  probe = ProbeModel(cfg, params, tokenizer, context=options.context, batch=options.batch,
                     capacity=probe_capacity(names, cfg, options), slots=options.batch)
  out = {}
  for name in names:
    started = time.perf_counter()
    scalars = SUITES[name](probe, options)
    scalars["seconds"] = time.perf_counter() - started
    log(f"eval suite {name}: {scalars['seconds']:.1f} s")
    out.update({f"eval/{name}/{k}": float(v) for k, v in scalars.items()})
  return out
