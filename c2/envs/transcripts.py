"""Tool-use SFT transcripts from the oracle: the tiny model learns the protocol before RL.

    python -m c2.envs.transcripts --out data/agentic --count 200 [--seed 0]
    python -m c2.main --config experiments/sft.py:tiny --workdir runs/sft-agentic \
      --config.data.source='jsonl:data/agentic/{split}-*.jsonl'

Each generated task is solved by the oracle policy inside the real environment (sandboxed tools,
graded: a transcript whose rollout does not score 1.0 is an error, never written), and the
conversation it produced becomes one record {"messages": [...], "tools": [...]} in the schema the
SFT pipeline reads (c2/data/examples.py): system, user task, then assistant turns with Kimi tool
calls and the tools' real outputs. Files are written as {split}-00000.jsonl for the train and
heldout splits of the generator.

`--slip-fraction F`: in a fraction F of the transcripts one edit is first made wrongly and fails;
the oracle then makes it right. `--slip-kinds` names the mistakes drawn from
(policies.slipped_edit): by default its search text is its replacement; `replacement_is_search`
makes the replacement its search text, which the edit tool rejects as a no-op. The failed reply
carries "weight": 0, so SFT trains the recovery from the error, never the mistake. Without such
transcripts a policy that makes one wrong call has seen no example of what follows an error, and
its later calls degenerate (measured on the tiny model).
"""
from __future__ import annotations

import argparse
import dataclasses
import concurrent.futures
import json
import os
import random
from typing import Iterable, Iterator, Optional, Sequence

from c2.envs import task_generator
from c2.envs.environment import CodingEnv, EnvConfig
from c2.envs.policies import SLIP_KINDS, OraclePolicy, run_episode
from c2.envs.tasks import SPLITS, Task
from c2.envs.tools import ToolConfig


def oracle_transcript(task: Task, config: EnvConfig = EnvConfig(),
                      slip_seed: Optional[int] = None,
                      slip_kinds: Sequence[str] = ("search_is_replacement",)) -> dict:
  """One SFT record from the oracle's rollout of `task` (raises if it does not score 1.0).

  With `slip_seed`, one edit is first tried wrongly (policies.slipped_edit) and then right: the
  wrong reply stays in the record with "weight": 0, context that is never trained on, so the
  model learns the recovery from the error but not the mistake.
  """
  env = CodingEnv(task, config)
  tools = env.tool_schemas()
  policy = OraclePolicy(task, as_text=False, thinking=config.thinking, slip_seed=slip_seed,
                        slip_kinds=slip_kinds)
  episode = run_episode(env, policy)
  if episode.reward.task != 1.0:
    raise RuntimeError(f"task {task.task_id}: the oracle scored {episode.reward.task}, not 1.0; "
                       f"grader output:\n{episode.grade_output[-2000:]}")
  if len(episode.segments) != 1:
    raise RuntimeError(f"task {task.task_id}: the oracle's rollout was summarised; transcripts "
                       "need a single context (raise summary.trigger_tokens)")
  messages = episode.segments[0]
  replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  for turn in policy.slip_turns:
    at = replies[turn]
    if not str(messages[at + 1].get("content", "")).startswith("Error:"):
      # The replacement text already occurs in the file, so the slip applied: no transcript
      # with a slip for this task (it would teach a wrong edit that happened to work).
      return oracle_transcript(task, config)
    messages[at] = {**messages[at], "weight": 0}
  return {"messages": messages, "tools": tools, "task_id": task.task_id}


def slip_seed_of(task: Task, seed: int, slip_fraction: float) -> Optional[int]:
  """The slip seed of `task` for a run, or None: a stable draw, so a transcript set is a prefix
  of any longer one made with the same arguments."""
  draw = random.Random(f"{seed}/{task.task_id}")
  return draw.randrange(2**31) if draw.random() < slip_fraction else None


def oracle_transcripts(tasks: Iterable[Task], config: EnvConfig = EnvConfig(),
                       workers: int = 4, slip_fraction: float = 0.0,
                       seed: int = 0,
                       slip_kinds: Sequence[str] = ("search_is_replacement",)) -> Iterator[dict]:
  """Transcripts in task order; rollouts run `workers` at a time (most of their time is spent
  waiting for sandboxed subprocesses). A `slip_fraction` of them recover from a slipped edit."""
  if not 0.0 <= slip_fraction <= 1.0:
    raise ValueError(f"slip_fraction must be in [0, 1], got {slip_fraction}")
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    yield from pool.map(lambda task: oracle_transcript(
        task, config, slip_seed_of(task, seed, slip_fraction), slip_kinds), tasks)


def write_split(path: str, records: Iterable[dict]) -> int:
  """Writes records as JSONL atomically (a temporary file renamed into place); returns the count."""
  temporary = f"{path}.tmp.{os.getpid()}"
  count = 0
  with open(temporary, "w") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")
      count += 1
  os.replace(temporary, path)
  return count


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m c2.envs.transcripts", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="directory for {split}-00000.jsonl")
  parser.add_argument("--count", type=int, default=200, help="tasks of the train split")
  parser.add_argument("--heldout-count", type=int, default=None, help="default: count // 4")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--tools", default=None,
                      help="comma-separated tools the environment offers (default: all; finish "
                           "is required); fewer tools make a shorter system prompt")
  parser.add_argument("--tool-declaration", default="full", choices=("full", "compact", "none"),
                      help="how the prompt declares the tools (environment.TOOL_DECLARATIONS)")
  parser.add_argument("--slip-fraction", type=float, default=0.0,
                      help="fraction of transcripts in which one edit is first tried wrongly "
                           "(--slip-kinds), fails, and is then made right (the failed reply is "
                           "kept with weight 0: context, not trained on)")
  parser.add_argument("--slip-kinds", default="search_is_replacement",
                      help=f"comma-separated kinds a slip is drawn from (policies.slipped_edit: "
                           f"{', '.join(SLIP_KINDS)})")
  parser.add_argument("--levels", default=None,
                      help="comma-separated levels of task_generator.LADDER (default: all)")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  config = EnvConfig(tool_declaration=args.tool_declaration)
  if args.tools:
    config = dataclasses.replace(config, tools=ToolConfig(enabled=tuple(args.tools.split(","))))
  levels = tuple(int(v) for v in args.levels.split(",")) if args.levels else None
  slip_kinds = tuple(args.slip_kinds.split(","))
  unknown = sorted(set(slip_kinds) - set(SLIP_KINDS))
  if unknown:
    parser.error(f"--slip-kinds: unknown {', '.join(unknown)}; "
                 f"choose from {', '.join(SLIP_KINDS)}")
  counts = {"train": args.count, "heldout": args.heldout_count or max(1, args.count // 4)}
  for split in SPLITS:
    tasks = task_generator.generate(args.seed, counts[split], split=split,
                                    **({"levels": levels} if levels else {}))
    path = os.path.join(args.out, f"{split}-00000.jsonl")
    written = write_split(path, oracle_transcripts(tasks, config, workers=args.workers,
                                                      slip_fraction=args.slip_fraction,
                                                      seed=args.seed, slip_kinds=slip_kinds))
    print(f"{split}: {written} transcripts -> {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
