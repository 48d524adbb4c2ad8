"""Agentic evaluation on held-out environment tasks: pass@1 and pass@k, the pass rate per task kind,
reward per component, tokens, tool calls, turns and wall time per task, and the inference cost of
each task.

    out = evaluate(cfg, params, tokenizer, tasks, samples=4, env_config=EnvConfig(),
                   sampling=SamplingParams(temperature=1.0, max_new_tokens=160), max_context=1536)

Every rollout is the RL phase's own (c2.rl.rollout.run_rollout on c2.envs.CodingEnv, token in and
token out, seeded as the RL learner seeds its held-out rollouts), served by one inference engine
on its own thread (c2.infer.server.EngineWorker) so that concurrent rollouts share decode steps.
The report evaluates this way: average reward and best-of-K on held-out tasks (section 4.10),
accuracy against median inference cost per task (section 7.1, Fig. 11).

Cost is analytic: the FLOPs of the tokens the engine processed (c2.perf.flops.forward_flops).
Each turn's request is the whole context so far and the engine keeps no cache between requests,
so a turn costs the prefill of its prompt plus the decode of its reply; a later prefix cache
would lower this, and the count would then have to follow it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import queue
import time
from typing import Optional, Sequence

import numpy as np

from c2.data.tokenizer import Tokenizer
from c2.envs.environment import CodingEnv, EnvConfig
from c2.envs.tasks import Task
from c2.evals import passk
from c2.infer.engine import Engine, Request, Result
from c2.infer.sampling import SamplingParams
from c2.infer.server import EngineWorker
from c2.model.config import ModelConfig
from c2.perf import flops
from c2.rl import metrics as rl_metrics
from c2.rl.rollout import Rollout, RolloutSpec, run_rollout
from c2.rl.workers import WorkerSpec

_STATS = ("sampled_tokens", "tool_calls", "turns", "context_tokens", "malformed_tool_calls",
          "seconds")


def rollout_flops(cfg: ModelConfig, rollout: Rollout) -> float:
  """Inference FLOPs of one rollout: per reply, prefill of the request (everything before it)
  and decode of the reply (its tokens but the last are fed back)."""
  total = 0.0
  for segment in rollout.segments:
    mask, t = segment.model_mask, 0
    while t < len(mask):
      if not mask[t]:
        t += 1
        continue
      start = t
      while t < len(mask) and mask[t]:
        t += 1
      total += flops.forward_flops(cfg, 0, start) + flops.forward_flops(cfg, start, t - 1)
  return total


def _blocking_generate(worker: EngineWorker):
  def generate(request: Request) -> Result:
    outbox: queue.Queue = worker.submit(request)
    while True:
      event = outbox.get()
      if event.result is not None:
        return event.result
  return generate


def run_rollouts(cfg: ModelConfig, params, tokenizer: Tokenizer, tasks: Sequence[Task], *,
                 samples: int, env_config: EnvConfig, sampling: SamplingParams, max_context: int,
                 slots: int = 8, workers: int = 8) -> list[tuple[Task, Optional[Rollout]]]:
  """`samples` rollouts of every task; a rollout that raises is (task, None)."""
  # As the RL engines run (c2/rl/workers.py, WorkerSpec's defaults): each turn prefills only
  # what the slot of the rollout's previous turn lacks, in chunks of 256. Measured, 16 tasks x 2
  # rollouts of runs/rl-drop (bf16): 97.5 -> 41.5 s, the decode batch 2.8 -> 6.2 of 8 rows busy
  # (turns no longer queue behind whole-context prefills).
  engine = Engine(cfg, params, slots=slots, capacity=max_context,
                  prefix_cache=WorkerSpec.prefix_cache, prefill_chunk=WorkerSpec.prefill_chunk)
  worker = EngineWorker(engine)
  generate = _blocking_generate(worker)
  count_tokens = lambda text: len(tokenizer.encode(text))

  def one(i: int, task: Task, k: int) -> Rollout:
    # The RL learner's held-out seeds (c2/rl/learner.py), so both report the same rollouts.
    spec = RolloutSpec(-(i + 1), k, task.task_id, seed=10_007 * (i + 1) + k)
    env = CodingEnv(task, env_config, count_tokens=count_tokens)
    return run_rollout(spec, env, generate, tokenizer, sampling, max_context=max_context)

  try:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      futures = [(task, pool.submit(one, i, task, k)) for i, task in enumerate(tasks)
                 for k in range(samples)]
      out = []
      for task, future in futures:
        try:
          out.append((task, future.result()))
        except Exception:  # pylint: disable=broad-except
          out.append((task, None))  # counted as an error and a failure
  finally:
    worker.close()
  return out


def _no_room(rollout: Rollout) -> bool:
  return bool(rollout.stats.get("truncated", 0)) and rollout.stats.get("sampled_tokens", 0) == 0


def summarize(cfg: ModelConfig, results: Sequence[tuple[Task, Optional[Rollout]]],
              samples: int, wall_seconds: float) -> dict[str, float]:
  """Suite scalars from (task, rollout) pairs; see the module docstring."""
  by_task = collections.defaultdict(list)
  for task, rollout in results:
    by_task[task.task_id].append(rollout is not None and rollout.passed)
  out = {f"pass_at_{k}": v for k, v in passk.pass_at_k_over_tasks(
      [(len(v), sum(v)) for v in by_task.values()], range(1, samples + 1)).items()}
  out.update(rl_metrics.pass_rate_by_kind((t.kind, r is not None and r.passed)
                                           for t, r in results))
  interval = rl_metrics.pass_rate((t.task_id, r is not None and r.passed) for t, r in results)
  out.update({k: v for k, v in interval.items() if k.startswith("pass_rate_ci")})
  rollouts = [r for _, r in results if r is not None]
  out.update(tasks=float(len(by_task)), rollouts=float(len(results)),
             errors=float(len(results) - len(rollouts)), wall_seconds=wall_seconds)
  if not rollouts:
    return out
  terms = collections.defaultdict(list)
  for r in rollouts:
    for name, value in r.reward_terms.items():
      terms[name].append(value)
  out.update({name: float(np.mean(v)) for name, v in terms.items()})  # reward/<component>
  for key in _STATS:
    out[f"{key}_per_task"] = float(np.mean([r.stats.get(key, 0) for r in rollouts]))
  # Rollouts that hit the context limit; `no_room` ones hit it before the first token (the prompt
  # alone filled the context), which scores 0 for a reason that has nothing to do with the model.
  out["truncated_rate"] = float(np.mean([r.stats.get("truncated", 0) for r in rollouts]))
  out["no_room_rate"] = float(np.mean([_no_room(r) for r in rollouts]))
  cost = [rollout_flops(cfg, r) for r in rollouts]
  out["flops_per_task_mean"] = float(np.mean(cost))
  out["flops_per_task_median"] = float(np.median(cost))
  return out


def evaluate(cfg: ModelConfig, params, tokenizer: Tokenizer, tasks: Sequence[Task], *,
             samples: int, env_config: EnvConfig, sampling: SamplingParams, max_context: int,
             slots: int = 8) -> dict[str, float]:
  started = time.perf_counter()
  results = run_rollouts(cfg, params, tokenizer, tasks, samples=samples, env_config=env_config,
                         sampling=sampling, max_context=max_context, slots=slots, workers=slots)
  rollouts = [r for _, r in results if r is not None]
  if rollouts and all(_no_room(r) for r in rollouts):
    raise ValueError(
        f"agentic eval: every task's prompt fills the rollout context (max_context={max_context} "
        f"tokens), so nothing was sampled; raise it (python -m c2.eval --agentic-context N, "
        f"config.rl.max_context) or use a shorter tool declaration (env tool_declaration)")
  return summarize(cfg, results, samples, time.perf_counter() - started)
