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
