#!/usr/bin/env python3
"""Expand an experiment's get_sweep() into one launch command per sweep point.

  python launch/sweep.py experiments/pretrain.py:proxy gs://my-bucket/runs/lr_sweep \\
      --launcher run -- --tpu c2-v5p --zone us-east5-a      # prints the commands
  python launch/sweep.py ... --execute -- ...               # runs them, one after another

get_sweep() (or get_sweep(arg)) lives in the experiment file and returns a list of dicts of
dotted config overrides, e.g. [{"optim.lr": 1e-4}, {"optim.lr": 3e-4, "optim.warmup": 500}].
Point i becomes one run of the launcher:
  workdir    WORKDIR/<i>_<leaf>=<value>,...   e.g. .../lr_sweep/01_lr=0.0003,warmup=500
  overrides  --config.optim.lr=0.0003 --config.optim.warmup=500   (after the launcher's `--`)
Every key is looked up in get_config(arg) first, so a typo fails here and not on a booked pod.

Launchers: run (TPU VM slice, launch/run.sh), xpk (GKE, launch/xpk.sh create), local
(launch/local.sh). Arguments after `--` go to the launcher unchanged (--tpu, --zone, --type,
--cluster, --dry-run, ...). Commands are printed for, and executed from, the repo root. On one
TPU VM slice the points run one after another; with xpk each point is its own workload.
"""
import argparse
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHERS = {
    "run": ["launch/run.sh"],
    "xpk": ["launch/xpk.sh", "create"],
    "local": ["launch/local.sh"],
}


def load_experiment(path):
    """Imports an experiment file by path, with the repo root importable as for c2.main."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    if not os.path.isfile(path):
        raise SystemExit(f"sweep: no experiment file {path}")
    stem = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"c2_sweep_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def format_value(value):
    """The VALUE text of --config.key=VALUE, as ml_collections' config_flags parses it back."""
    return value if isinstance(value, str) else str(value)


def run_suffix(index, point):
    """Workdir suffix of one point: its index (unique) and leaf=value pairs (readable)."""
    pairs = ",".join(f"{key.rsplit('.', 1)[-1]}={format_value(v)}" for key, v in point.items())
    return f"{index:02d}_" + re.sub(r"[^A-Za-z0-9._=,+-]", "-", pairs)


def check_key(config, key):
    """Fails unless the dotted key names a field of the experiment's config."""
    node = config
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            raise SystemExit(f"sweep: key {key!r} is not in get_config(): no field {part!r}")


def expand(experiment, workdir):
    """[(run workdir, [--config.k=v, ...])] for every point of the experiment's get_sweep()."""
    path, has_arg, arg = experiment.partition(":")
    arg = arg if has_arg else None
    module = load_experiment(path)
    if not hasattr(module, "get_sweep"):
        raise SystemExit(f"sweep: {path} defines no get_sweep()")
    config = module.get_config(arg) if has_arg else module.get_config()
    takes_arg = bool(inspect.signature(module.get_sweep).parameters)
    points = module.get_sweep(arg) if takes_arg else module.get_sweep()
    runs = []
    for index, point in enumerate(points):
        for key in point:
            check_key(config, key)
        overrides = [f"--config.{key}={format_value(v)}" for key, v in point.items()]
        runs.append((f"{workdir.rstrip('/')}/{run_suffix(index, point)}", overrides))
    return runs


def repo_relative(experiment):
    """The experiment spec with its path relative to the repo root (absolute if outside)."""
    path, has_arg, arg = experiment.partition(":")
    rel = os.path.relpath(os.path.abspath(path), REPO_ROOT)
    path = os.path.abspath(path) if rel.startswith("..") else rel
    return f"{path}:{arg}" if has_arg else path


def commands(experiment, workdir, launcher, launcher_args):
    """One argv per sweep point: launcher, its flags, experiment, run workdir, -- overrides."""
    return [
        [*LAUNCHERS[launcher], *launcher_args, repo_relative(experiment), run_workdir, "--",
         *overrides]
        for run_workdir, overrides in expand(experiment, workdir)
    ]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", help="experiments/<phase>.py[:<arg>]")
    parser.add_argument("workdir", help="parent workdir; each point runs in a subdirectory")
    parser.add_argument("--launcher", choices=sorted(LAUNCHERS), default="run")
    parser.add_argument("--execute", action="store_true",
                        help="run the commands one after another instead of printing them")
    args = parser.parse_args(argv[:split])
    cmds = commands(args.experiment, args.workdir, args.launcher, argv[split + 1:])
    if not cmds:
        print(f"sweep: {args.experiment} has an empty sweep", file=sys.stderr)
    for cmd in cmds:
        print(shlex.join(cmd), flush=True)
        if args.execute:
            subprocess.run(cmd, cwd=REPO_ROOT, check=True)


if __name__ == "__main__":
    main()
