"""Throughput of the coding environment (c2/envs) with and without the sandbox, side by side.

  python -m c2.bench envs                                  # 1, 8, 32 environments; all modes
  python -m c2.bench envs --concurrency 1,4 --rollouts 8 --modes none,rlimits --json out.json

The workload is oracle rollouts (c2/envs/policies.py) of a fixed seeded pool of generated tasks,
one or more of each ladder entry (c2/envs/task_generator.py), taken in the same order for every
measurement: construction of the environment (its workspace), reset, the oracle's tool calls
(file tools, and `run` of the visible tests where the solution has them), finish, reward() (the
hidden tests graded in the sandbox), close. N concurrent environments are N threads running
rollouts back to back, max(--rollouts, 2N) rollouts in all per N, so each worker runs at least two.

Isolation modes share one code path, EnvConfig(tools=ToolConfig(run_limits=SandboxLimits(
isolation=mode))), which the grading also goes through:
  none     a plain subprocess: the unsandboxed baseline
  rlimits  private uid, rlimits, the tree-killing init (c2/envs/sandbox.py)
  bwrap    rlimits plus bubblewrap namespaces (skipped, and said so, where bwrap does not work)
Only `run` and grading start processes; the file tools run in this process whatever the mode, so
their latency moves only through contention for the CPUs and the GIL.

Per (mode, N): rollouts/s (rollouts / wall time of the whole pool), tool-call latency p50/p99
(each Tools.call timed on its own, read-only calls of one turn may overlap), the same for file
tools and for `run`, and grade latency (the reward() call). Then, per N, the ratios of each
sandboxed mode to none, measured in the same run. CPU timings are noisy: read the ratios, and
compare ratios only within one N. One untimed warm-up rollout per mode first (the bwrap probe,
the sandbox uid files, the page cache).
Exits 1 when any oracle rollout did not score task reward 1.0 or raised: a fast environment that
grades wrong is no result.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from c2.envs import environment, sandbox, task_generator
from c2.envs.policies import OraclePolicy, run_episode
from c2.envs.tasks import Task
from c2.envs.tools import ToolConfig

MODES = ("none", "rlimits", "bwrap")
FILE_TOOLS = frozenset({"read_file", "edit_file", "write_file", "list_dir", "grep"})


def env_config(mode: str) -> environment.EnvConfig:
  return environment.EnvConfig(tools=ToolConfig(run_limits=sandbox.SandboxLimits(isolation=mode)))


def task_pool(seed: int, count: int) -> list[Task]:
  """`count` train tasks cycling through the whole ladder (levels 1-5), deterministic in seed."""
  return task_generator.generate(seed, count, split="train")


def _timed(fn: Callable, sink: list, label: Optional[str] = None) -> Callable:
  """fn, recording (label or the first argument, seconds) of each call into sink, errors too."""
  def wrapper(*args, **kwargs):
    start = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      # list.append is atomic under the GIL: the env's read-only calls come from a thread pool.
      sink.append((label or args[0], time.perf_counter() - start))
  return wrapper


def rollout(task: Task, config: environment.EnvConfig) -> dict:
  """One oracle rollout through the canonical loop (policies.run_episode). Timing wrappers go on
  this environment's instance only, so nothing global is patched and the calls are the real ones.
  -> {"task_id", "task_reward", "seconds", "calls": [(tool, s)], "grade_seconds", "output"}."""
  start = time.perf_counter()
  env = environment.CodingEnv(task, config)
  calls, grades = [], []
  env.tools.call = _timed(env.tools.call, calls)
  env.reward = _timed(env.reward, grades, "grade")
  episode = run_episode(env, OraclePolicy(task))
  return {"task_id": task.task_id, "task_reward": episode.reward.task,
          "seconds": time.perf_counter() - start, "calls": calls,
          "grade_seconds": grades[0][1], "output": episode.grade_output}


def _percentiles(seconds: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
  """(p50, p99) in milliseconds, None without samples (a mode that made no such call)."""
  if not seconds:
    return None, None
  p50, p99 = np.percentile(np.asarray(seconds) * 1e3, [50, 99])
  return float(p50), float(p99)


def measure(tasks: Sequence[Task], mode: str, concurrency: int, rollouts: int) -> dict:
  """`rollouts` oracle rollouts (task i % len(tasks)) on `concurrency` threads in one mode."""
  config = env_config(mode)
  failures, lock = [], threading.Lock()

  def one(index: int) -> Optional[dict]:
    task = tasks[index % len(tasks)]
    try:
      result = rollout(task, config)
    except Exception as e:  # pylint: disable=broad-except  # reported, and the bench exits 1
      with lock:
        failures.append(f"{task.task_id}: raised {type(e).__name__}: {e}")
      return None
    if result["task_reward"] != 1.0:
      with lock:
        failures.append(f"{task.task_id}: task reward {result['task_reward']:.3f} != 1.0; grading "
                        f"output tail: {result['output'][-300:]!r}")
    return result

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    results = [r for r in pool.map(one, range(rollouts)) if r is not None]
  wall = time.perf_counter() - start
  calls = [c for r in results for c in r["calls"]]
  kinds = {"call": [s for _, s in calls], "file": [s for n, s in calls if n in FILE_TOOLS],
           "run": [s for n, s in calls if n == "run"],
           "grade": [r["grade_seconds"] for r in results]}
  figures = {"mode": mode, "concurrency": concurrency, "rollouts": rollouts,
             "completed": len(results), "seconds": wall, "rollouts_per_s": len(results) / wall,
             "min_task_reward": min((r["task_reward"] for r in results), default=None),
             "failures": failures}
  for kind, seconds in kinds.items():
    figures[f"{kind}_count"] = len(seconds)
    figures[f"{kind}_p50_ms"], figures[f"{kind}_p99_ms"] = _percentiles(seconds)
  return figures


RATIO_KEYS = ("rollouts_per_s", "call_p50_ms", "file_p50_ms", "run_p50_ms", "grade_p50_ms")


def ratios(sandboxed: dict, baseline: dict) -> dict:
  """sandboxed / none for the figures of RATIO_KEYS (None where either side has no sample)."""
  out = {"mode": sandboxed["mode"], "concurrency": sandboxed["concurrency"]}
  for key in RATIO_KEYS:
    a, b = sandboxed[key], baseline[key]
    out[key] = a / b if a is not None and b else None
  return out


def _ms(value: Optional[float], width: int = 10) -> str:
  return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"


def _ratio(value: Optional[float], width: int = 10) -> str:
  return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m c2.bench envs", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--concurrency", default="1,8,32", help="comma-separated environment counts")
  parser.add_argument("--rollouts", type=int, default=16,
                      help="rollouts per concurrency N: max(this, 2N)")
  parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {MODES}")
  parser.add_argument("--tasks", type=int, default=2 * len(task_generator.LADDER),
                      help="size of the task pool (cycles through the ladder)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", help="write the figures here")
  args = parser.parse_args(argv)
  levels = [int(n) for n in args.concurrency.split(",")]
  modes = [m for m in args.modes.split(",") if m]
  unknown = set(modes) - set(MODES)
  if unknown or not modes or min(levels) < 1 or args.rollouts < 1 or args.tasks < 1:
    parser.error(f"modes must be of {MODES}; concurrency, rollouts and tasks positive")

  bwrap = sandbox.bwrap_problem()
  if "bwrap" in modes and bwrap is not None:
    print(f"bwrap: not measured on this machine ({bwrap})")
    modes.remove("bwrap")
  tasks = task_pool(args.seed, args.tasks)
  cpus = len(os.sched_getaffinity(0))
  print(f"oracle rollouts of {len(tasks)} generated tasks (seed {args.seed}, levels 1-5, "
        f"{sum(t.visible_test_command is not None for t in tasks)} with a visible-test `run`), "
        f"{cpus} CPUs, root: {os.geteuid() == 0}, modes {', '.join(modes)}")
  for mode in modes:  # untimed warm-up
    rollout(tasks[0], env_config(mode))

  results, table, failures = [], [], []
  print(f"\n{'mode':<8}{'N':>4}{'rollouts':>9}{'s':>7}{'roll/s':>8}{'call p50':>10}"
        f"{'call p99':>10}{'file p50':>10}{'run p50':>10}{'run p99':>10}{'grade p50':>10}"
        f"{'grade p99':>10}   (ms)")
  for n in levels:
    by_mode = {}
    for mode in modes:
      r = measure(tasks, mode, n, max(args.rollouts, 2 * n))
      by_mode[mode] = r
      results.append(r)
      failures += [f"{mode} N={n}: {f}" for f in r["failures"]]
      print(f"{mode:<8}{n:>4}{r['completed']:>9}{r['seconds']:>7.1f}{r['rollouts_per_s']:>8.2f}"
            + "".join(_ms(r[f"{k}_{p}_ms"]) for k, p in (
                ("call", "p50"), ("call", "p99"), ("file", "p50"), ("run", "p50"),
                ("run", "p99"), ("grade", "p50"), ("grade", "p99"))))
    if "none" in by_mode:
      table += [ratios(by_mode[m], by_mode["none"]) for m in modes if m != "none"]

  if table:
    print(f"\n{'sandboxed / none':<18}{'N':>4}{'roll/s':>10}{'call p50':>10}{'file p50':>10}"
          f"{'run p50':>10}{'grade p50':>10}")
    for row in table:
      print(f"{row['mode']:<18}{row['concurrency']:>4}"
            + "".join(_ratio(row[k]) for k in RATIO_KEYS))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"cpus": cpus, "bwrap_problem": bwrap, "seed": args.seed,
                 "tasks": [t.task_id for t in tasks], "results": results, "ratios": table,
                 "failures": failures}, f, indent=1)
  if failures:
    print(f"\nFAILED: {len(failures)} oracle rollouts did not score 1.0:")
    for failure in failures[:20]:
      print("  " + failure)
    return 1
  return 0
