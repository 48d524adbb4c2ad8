"""Shared by the launch tests: paths, a clean-environment script runner, dry-run parsing.

No test here touches gcloud, xpk or the network: every script runs with --dry-run (or
C2_DRY_RUN=1), which prints the exact commands, one shell line each, instead of running them.
"""
import os
import shlex
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH = REPO_ROOT / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh"))
SOURCED = {"env.sh", "lib.sh"}   # libraries, not entry points
ENTRY_POINTS = [s for s in SCRIPTS if s.name not in SOURCED]


def commands(stdout):
    """The printed commands parsed back into argv lists; `# ...` note lines are dropped."""
    return [shlex.split(line) for line in stdout.splitlines()
            if line.strip() and not line.startswith("#")]


def remote_command(argv):
    """The --command of a `gcloud compute tpus tpu-vm ssh ... --command CMD` argv."""
    return argv[argv.index("--command") + 1]


def run_script(script, *args, home, check=True, **env):
    """Runs launch/SCRIPT with no C2_* variables from the caller, HOME=home and a venv path
    that does not exist; returns the CompletedProcess."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("C2_")}
    clean.update({"HOME": str(home), "C2_VENV": str(Path(home) / "no-venv"), **env})
    proc = subprocess.run(["bash", str(LAUNCH / script), *args], capture_output=True, text=True,
                          env=clean, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def worker_commands(argv, home):
    """The commands worker.sh prints (dry run) for a `bash launch/worker.sh ARGS...` found in
    argv, directly or inside a remote/xpk command string; [] when there is none."""
    for text in [argv] + [shlex.split(a) for a in argv if "launch/worker.sh" in a and " " in a]:
        words = [w for w in text]
        if "launch/worker.sh" in words:
            args = words[words.index("launch/worker.sh") + 1:]
            if "&" in args:
                args = args[:args.index("&")]
            proc = run_script("worker.sh", *args, home=home, C2_DRY_RUN="1")
            return commands(proc.stdout)
    return []


def parse_c2(argv):
    """Parses a printed `python3 -m c2.main|c2.aot ...` command with the parser that module
    runs (c2.main.parse / c2.aot.parse), from the repo root as the launchers run it. Returns
    (ExperimentConfig, flag values) for c2.main and (ExperimentConfig, topology) for c2.aot."""
    import c2.aot  # pylint: disable=import-outside-toplevel
    import c2.main  # pylint: disable=import-outside-toplevel
    start = argv.index("-m")
    module, args = argv[start + 1], argv[start + 2:]
    if "2>&1" in args:   # worker.sh tees the output: the shell's part, not the program's
        args = args[:args.index("2>&1")]
    parse = {"c2.main": c2.main.parse, "c2.aot": c2.aot.parse}[module]
    cwd = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        return parse([module, *args])
    finally:
        os.chdir(cwd)
