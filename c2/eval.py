"""Evaluate checkpoints with the c2 suites; print a table and where the figures are.

  python -m c2.eval --checkpoint runs/tiny --suite base
  python -m c2.eval --checkpoint runs/tiny --steps all --suite codebase,state_tracking,long_context
  python -m c2.eval --checkpoint runs/rl-tiny --suite agentic --samples 8 --out runs/rl-tiny/evals

--checkpoint takes one or more comma-separated directories: a c2 training workdir (its latest
step, or --steps all|60,120), a converted checkpoint or a Hugging Face DeepseekV3/Kimi directory
(c2/infer/loading.py). Suites (c2/evals/suites.py): codebase, state_tracking, knowledge,
long_context, ruler, agentic; groups base (the three base-model probes) and all. Results merge into
OUT/results.json (default OUT: the first checkpoint's evals/), so figures compare every checkpoint
evaluated there; figures go to OUT/plots (PNG, SVG and the JSON behind each) and TensorBoard
(OUT/tb). The same suites run inside training with --config.train.eval_suites=base.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional

from c2 import cli
from c2.envs import config as env_config_lib
from c2.evals import report, suites
from c2.infer import loading
from c2.train.metrics import MetricWriter

_DEFAULT_CONTEXT = 2048  # for checkpoints that do not say what context they were trained at


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--checkpoint", required=True, help="DIR[,DIR...]: workdir, converted or HF dir")
  p.add_argument("--suite", default="base", help="NAME[,NAME]: suites or groups (base, all)")
  p.add_argument("--steps", default="latest", help="workdirs: latest | all | 60,120")
  p.add_argument("--out", default=None, help="results, figures, TensorBoard (default DIR/evals)")
  p.add_argument("--label", default=None, help="name of a single checkpoint in the results")
  p.add_argument("--dtype", choices=loading.DTYPES, default=None, help="override compute dtype")
  o = suites.SuiteOptions()
  p.add_argument("--context", type=int, default=0,
                 help="probe window (default: the run's data.seq_len, else 2048)")
  p.add_argument("--stride", type=int, default=o.stride, help="rolling stride (0: context / 2)")
  p.add_argument("--batch", type=int, default=o.batch)
  p.add_argument("--seed", type=int, default=o.seed)
  p.add_argument("--codebase-bytes", type=int, default=o.codebase_bytes,
                 help="of the held-out corpus (0: all of it)")
  p.add_argument("--state-examples", type=int, default=o.state_examples)
  p.add_argument("--knowledge", default=None, help="JSONL of {question, answer} (default: builtin)")
  p.add_argument("--knowledge-questions", type=int, default=o.knowledge_questions)
  p.add_argument("--lengths", default="", help="long-context lengths, e.g. 1024,4096")
  p.add_argument("--long-examples", type=int, default=o.long_examples)
  p.add_argument("--tasks", default=o.agentic_tasks, help="generated | jsonl:PATH")
  p.add_argument("--task-count", type=int, default=o.agentic_count)
  p.add_argument("--task-levels", default="1")
  p.add_argument("--samples", type=int, default=o.agentic_samples, help="rollouts per task")
  p.add_argument("--max-new-tokens", type=int, default=o.agentic_max_new_tokens)
  p.add_argument("--agentic-context", type=int, default=0, help="0: the run's rollout context")
  p.add_argument("--temperature", type=float, default=o.agentic_temperature)
  p.add_argument("--positions-from", default=None, metavar="WORKDIR",
                 help="evaluate under that run's RoPE settings (rope_scaling, "
                      "max_position_embeddings): a checkpoint as a long-context extension from "
                      "it sees it at its step 0")
  p.add_argument("--env-experiment", default=None,
                 help="take the environment section of this experiment (e.g. experiments/rl.py:"
                      "tiny) instead of the checkpoint's own (or the defaults)")
  return p.parse_args(argv)


def _experiment(path: str) -> dict:
  config = os.path.join(path, "tb", "config.json")
  if not os.path.exists(config):
    return {}
  with open(config) as f:
    return json.load(f)


def _workdir_steps(path: str, spec: str) -> list[Optional[int]]:
  """Steps of a training workdir to evaluate; [None] for other directories (their one model)."""
  ckpt = os.path.join(path, "ckpt")
  if not _experiment(path) or not os.path.isdir(ckpt):
    return [None]
  present = sorted(int(n) for n in os.listdir(ckpt) if re.fullmatch(r"\d+", n))
  if spec == "latest":
    return present[-1:] or [None]
  if spec == "all":
    return present
  wanted = [int(s) for s in spec.split(",")]
  missing = sorted(set(wanted) - set(present))
  if missing:
    raise SystemExit(f"c2.eval: {path} has no checkpoint at steps {missing} (has {present})")
  return wanted


def _with_positions_of(cfg, workdir: str):
  """cfg with the RoPE range and scaling of the run in `workdir` (its tb/config.json)."""
  experiment = _experiment(workdir)
  if not experiment:
    raise SystemExit(f"c2.eval: --positions-from {workdir}: no tb/config.json there (give a c2 "
                     "training workdir)")
  other = loading.workdir_model_config(experiment, os.path.join(workdir, "tb", "config.json"))
  return cfg.replace(rope_scaling=other.rope_scaling,
                     max_position_embeddings=other.max_position_embeddings)


def _options(args, experiment: dict, max_positions: int) -> suites.SuiteOptions:
  data, rl = experiment.get("data") or {}, experiment.get("rl") or {}
  context = min(args.context or data.get("seq_len") or _DEFAULT_CONTEXT, max_positions)
  env = experiment.get("env")
  if args.env_experiment:
    env = cli.load_experiment(args.env_experiment).get("env")
    if env is None:
      raise SystemExit(f"c2.eval: {args.env_experiment} has no env section")
  return suites.SuiteOptions(
      context=context, stride=args.stride, batch=args.batch, seed=args.seed,
      codebase_bytes=args.codebase_bytes, state_examples=args.state_examples,
      knowledge_path=args.knowledge, knowledge_questions=args.knowledge_questions,
      long_lengths=tuple(int(v) for v in args.lengths.split(",") if v),
      long_examples=args.long_examples, agentic_tasks=args.tasks, agentic_count=args.task_count,
      agentic_levels=tuple(int(v) for v in args.task_levels.split(",")),
      agentic_samples=args.samples, agentic_max_new_tokens=args.max_new_tokens,
      agentic_max_context=args.agentic_context or rl.get("max_context") or context,
      agentic_temperature=args.temperature,
      env=env_config_lib.to_env_config(env) if env else suites.SuiteOptions.env)


def main(argv=None) -> None:
  args = parse_args(argv)
  try:
    names = suites.parse_suites(args.suite)
  except ValueError as e:
    raise SystemExit(f"c2.eval: {e}") from None
  paths = [p for p in args.checkpoint.split(",") if p]
  out = args.out or os.path.join(paths[0], "evals")
  writer = MetricWriter(os.path.join(out, "tb"), enabled=True)
  results, last_step = {}, 0
  for path in paths:
    steps = _workdir_steps(path, args.steps)
    for step in steps:
      try:
        cfg, params, tokenizer = loading.load_for_serving(path, args.dtype, step)
      except loading.LoadError as e:
        raise SystemExit(f"c2.eval: {e}") from None
      if args.positions_from:
        cfg = _with_positions_of(cfg, args.positions_from)
      options = _options(args, _experiment(path), cfg.max_position_embeddings)
      name = os.path.basename(os.path.normpath(path))
      label = args.label if args.label and len(paths) * len(steps) == 1 else (
          name if step is None else f"{name}@{step}")
      print(f"c2.eval: {label}: suites {', '.join(names)} (context {options.context})",
            flush=True)
      scalars = suites.run_suites(names, cfg, params, tokenizer, options,
                                  log=lambda m: print(f"  {m}", flush=True))
      last_step = step or 0
      writer.write_scalars(last_step, scalars)
      results = report.record(out, label, step, scalars)
  figures = report.publish(out, results, writer, last_step)
  writer.close()
  shown = [k for k in report.natural_sorted({k for m in results.values() for k in m})
           if k.split("/")[1] in names]
  print("\n" + report.format_table(results, shown))
  print(f"\nresults:     {os.path.join(out, report.RESULTS_FILE)}")
  for name, png in sorted(figures.items()):
    print(f"figure:      {png} (+ .svg, .json)")
  print(f"TensorBoard: tensorboard --logdir {os.path.join(out, 'tb')}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
