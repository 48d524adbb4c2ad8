"""Static checks on launch/: shellcheck, usage text, one env file, file sizes."""
import os
import shutil
import subprocess

import pytest
from launchtest import ENTRY_POINTS, LAUNCH, SCRIPTS

SHELLCHECK = shutil.which("shellcheck")


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck binary not installed "
                    "(apt-get update && apt-get install -y shellcheck)")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    # launch/.shellcheckrc makes it follow `source "$here/env.sh"`, so no -x is needed.
    proc = subprocess.run([SHELLCHECK, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", ENTRY_POINTS, ids=lambda p: p.name)
def test_help_and_strict_mode(launch, script):
    proc = launch(script.name, "-h")
    assert "usage:" in proc.stdout and proc.stdout.splitlines()[0]   # header comment, line 2 on
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert 'source "$here/env.sh"' in text   # every script sees the one set of TPU flags
    # The READMEs run them as `launch/NAME.sh`: without the executable bit (a clean clone takes
    # it from git's index) that is "Permission denied", as agentic_pipeline.sh once was.
    assert os.access(script, os.X_OK), f"chmod +x {script.name} (and git add it)"


def test_tpu_flags_live_in_env_sh_only(tmp_path):
    for path in SCRIPTS:
        if path.name != "env.sh":
            assert "LIBTPU_INIT_ARGS=" not in path.read_text(), path.name
    probe = f'source {LAUNCH / "env.sh"}; echo "$LIBTPU_INIT_ARGS"'
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "C2_EXTRA_LIBTPU_ARGS": "--xla_extra=1"}
    flags = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env=env,
                           check=True).stdout.split()
    assert "--xla_tpu_enable_async_collective_fusion=true" in flags
    assert "--xla_tpu_megacore_fusion_allow_ags=false" in flags
    assert flags[-1] == "--xla_extra=1"


def test_files_stay_small():
    for path in LAUNCH.iterdir():
        if path.is_file() and not path.name.startswith("."):
            lines = len(path.read_text().splitlines())
            assert 30 <= lines <= 200, f"{path.name}: {lines} lines"
