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
"""
from __future__ import annotations

import argparse
import dataclasses
import concurrent.futures
import json
import os
from typing import Iterable, Iterator, Optional, Sequence

from c2.envs import task_generator
from c2.envs.environment import CodingEnv, EnvConfig
from c2.envs.policies import OraclePolicy, run_episode
from c2.envs.tasks import SPLITS, Task
from c2.envs.tools import ToolConfig


def oracle_transcript(task: Task, config: EnvConfig = EnvConfig()) -> dict:
  """One SFT record from the oracle's rollout of `task` (raises if it does not score 1.0)."""
  env = CodingEnv(task, config)
  tools = env.tool_schemas()
  episode = run_episode(env, OraclePolicy(task, as_text=False, thinking=config.thinking))
  if episode.reward.task != 1.0:
    raise RuntimeError(f"task {task.task_id}: the oracle scored {episode.reward.task}, not 1.0; "
                       f"grader output:\n{episode.grade_output[-2000:]}")
  if len(episode.segments) != 1:
    raise RuntimeError(f"task {task.task_id}: the oracle's rollout was summarised; transcripts "
                       "need a single context (raise summary.trigger_tokens)")
  return {"messages": episode.segments[0], "tools": tools, "task_id": task.task_id}


def oracle_transcripts(tasks: Iterable[Task], config: EnvConfig = EnvConfig(),
                       workers: int = 4) -> Iterator[dict]:
  """Transcripts in task order; rollouts run `workers` at a time (most of their time is spent
  waiting for sandboxed subprocesses)."""
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    yield from pool.map(lambda task: oracle_transcript(task, config), tasks)


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
  parser.add_argument("--levels", default=None,
                      help="comma-separated difficulty levels of task_generator.LADDER (default: all)")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  config = EnvConfig(tool_declaration=args.tool_declaration)
  if args.tools:
    config = dataclasses.replace(config, tools=ToolConfig(enabled=tuple(args.tools.split(","))))
  levels = tuple(int(v) for v in args.levels.split(",")) if args.levels else None
  counts = {"train": args.count, "heldout": args.heldout_count or max(1, args.count // 4)}
  for split in SPLITS:
    tasks = task_generator.generate(args.seed, counts[split], split=split, **({"levels": levels} if levels else {}))
    path = os.path.join(args.out, f"{split}-00000.jsonl")
    written = write_split(path, oracle_transcripts(tasks, config, workers=args.workers))
    print(f"{split}: {written} transcripts -> {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
