"""Launch tests: make launchtest.py importable and give each test a script runner."""
import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launchtest import run_script  # noqa: E402


@pytest.fixture
def launch(tmp_path):
    """launch(script, *args, check=True, **env) -> CompletedProcess (see run_script)."""
    return functools.partial(run_script, home=tmp_path / "home")
