"""Grading: a test run's output -> per-test outcomes -> the task reward.

Grading reads text, never the sandbox: `parse_test_output` understands unittest's verbose output
(`test_x (pkg.mod.Class.test_x) ... ok`, with the failure section's `FAIL: ...` headers) and
pytest's `-rA` summary (`PASSED path::test`) and `-v` lines (`path::test PASSED [ 50%]`).
Test commands must be verbose: unittest's default and `-q` output name only the failures, so a
test that passed would be indistinguishable from one that never ran.

Test names are canonical: unittest tests as `pkg.mod.Class.test_x` (counted names written the
older `test_x (pkg.mod.Class)` way, as SWE-bench's Django tasks do, are converted), pytest tests
as their node ids. A counted test that the output never mentions counts as failed, so a command
that did not run at all (an import-time syntax error, a missing tool) scores 0.

The output comes from the process that runs the policy's code, so a policy could print fake
result lines. Two rules make that harder, not impossible: when a test is reported more than once
the worst outcome wins (the failure section or the real line overrides a forged "ok"), and a
module that failed to import (unittest's `_FailedTest`, pytest's `ERROR path`) fails every
counted test in it. An environment that must be robust to adversarial policies should run a
runner that writes results outside the workspace.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Iterable, Mapping, Optional

from c2.envs.tasks import Task, write_files

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
_SEVERITY = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}  # worst outcome wins on repeats
REWARD_MODES = ("fraction", "binary")

_UNITTEST_STATUS = {"ok": PASSED, "FAIL": FAILED, "ERROR": ERROR, "skipped": SKIPPED,
                    "expected failure": PASSED, "unexpected success": FAILED}
# "test_x (pkg.mod.Class.test_x)" then " ... ok", optionally after a docstring line, optionally
# with a subTest's "(i=1)"; statuses are unittest's TextTestResult words.
_UNITTEST_LINE = re.compile(
    r"^[ \t]*(?P<method>[\w.]+) \((?P<qualname>[\w.]+)\)(?: \([^\n]*\))?(?:\n[^\n]*?)?"
    r" \.\.\. (?P<status>ok|FAIL|ERROR|skipped|expected failure|unexpected success)\b",
    re.MULTILINE)
_UNITTEST_HEADER = re.compile(
    r"^(?P<status>FAIL|ERROR): (?P<method>[\w.]+) \((?P<qualname>[\w.]+)\)", re.MULTILINE)
_PYTEST_STATUS = {"PASSED": PASSED, "FAILED": FAILED, "ERROR": ERROR, "SKIPPED": SKIPPED,
                  "XFAIL": PASSED, "XPASS": FAILED}  # as SWE-bench's harness counts them
# A node id is a file (collection errors) or file::test; unittest's "FAILED (failures=1)" is not.
_PYTEST_SUMMARY = re.compile(
    r"^(?P<status>PASSED|FAILED|ERROR|XFAIL|XPASS) (?P<name>[^\s:]+\.py(?:::\S+)?)", re.MULTILINE)
_PYTEST_VERBOSE = re.compile(
    r"^(?P<name>\S+::\S+) (?P<status>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)
_OLD_UNITTEST_NAME = re.compile(r"^(?P<method>\w+) \((?P<qualname>[\w.]+)\)$")


def _unittest_name(method: str, qualname: str) -> str:
  """Python >= 3.11 prints `Class.test_x` as the qualname, older versions just `Class`."""
  if qualname.startswith("unittest.loader._FailedTest"):
    return method  # a module that failed to import: its (dotted or last) name is the "method"
  return qualname if qualname.rsplit(".", 1)[-1] == method else f"{qualname}.{method}"


def normalize_test_name(name: str) -> str:
  """Canonical form of a counted test name (see the module docstring)."""
  match = _OLD_UNITTEST_NAME.match(name.strip())
  return _unittest_name(match["method"], match["qualname"]) if match else name.strip()


def parse_test_output(output: str) -> dict[str, str]:
  """Test name -> outcome (PASSED/FAILED/ERROR/SKIPPED) for every test the output reports."""
  outcomes: dict[str, str] = {}

  def record(name: str, outcome: str):
    if _SEVERITY[outcome] >= _SEVERITY.get(outcomes.get(name, PASSED), 0):
      outcomes[name] = outcome

  for m in _UNITTEST_LINE.finditer(output):
    record(_unittest_name(m["method"], m["qualname"]), _UNITTEST_STATUS[m["status"]])
  for m in _UNITTEST_HEADER.finditer(output):
    record(_unittest_name(m["method"], m["qualname"]), _UNITTEST_STATUS[m["status"]])
  for m in _PYTEST_SUMMARY.finditer(output):
    record(m["name"], _PYTEST_STATUS[m["status"]])
  for m in _PYTEST_VERBOSE.finditer(output):
    record(m["name"], _PYTEST_STATUS[m["status"]])
  return outcomes


def _containers(name: str) -> Iterable[str]:
  """Names whose failure fails `name`: its pytest file, or its unittest module and packages."""
  if "::" in name:
    yield name.split("::", 1)[0]
  else:
    parts = name.split(".")
    for end in range(1, len(parts)):
      yield ".".join(parts[:end])


def outcome_of(name: str, outcomes: Mapping[str, str]) -> str:
  """The outcome that counts for one test: missing -> FAILED; a failed import wins."""
  name = normalize_test_name(name)
  found = [outcomes[name]] if name in outcomes else [FAILED]
  for container in _containers(name):  # `-m unittest pkg.mod` names a failed module by its tail
    for failed in (container, container.rsplit(".", 1)[-1]):
      found += [ERROR] if outcomes.get(failed) == ERROR else []
  return max(found, key=_SEVERITY.__getitem__)


def task_reward(outcomes: Mapping[str, str], counted_names: Iterable[str],
                mode: str = "fraction") -> float:
  """Fraction of the counted tests that passed ("fraction") or 1.0 iff all did ("binary").

  With no counted names every reported test counts; nothing reported scores 0.
  """
  if mode not in REWARD_MODES:
    raise ValueError(f"mode must be one of {REWARD_MODES}, got {mode!r}")
  names = list(counted_names) or list(outcomes)
  if not names:
    return 0.0
  passed = sum(outcome_of(n, outcomes) == PASSED for n in names)
  if mode == "binary":
    return float(passed == len(names))
  return passed / len(names)


@dataclasses.dataclass(frozen=True)
class GradeResult:
  reward: float
  passed: int
  total: int
  outcomes: Mapping[str, str]  # every test the run reported, counted or not
  output: str
  exit_code: int


RunCommandFn = Callable[[str, pathlib.Path], tuple[int, str]]


def grade(task: Task, workspace_root: str | os.PathLike, run_command_fn: RunCommandFn, *,
          mode: str = "fraction", in_place: bool = False,
          scratch_dir: Optional[str | os.PathLike] = None) -> GradeResult:
  """Adds the hidden files, runs the task's test command and scores it.

  By default the workspace is copied (into a temporary folder under scratch_dir) and the copy is
  graded, so the policy's workspace stays as it left it and the hidden tests never leak into a
  continuing episode. `in_place=True` writes the hidden files into workspace_root itself, for
  sandboxes that can only run commands in their own workspace; the hidden files then stay there.

  run_command_fn(command, root) -> (exit_code, stdout and stderr merged) runs the command with
  root as working directory: the environment passes its sandboxed runner (with scratch_dir a
  folder the sandbox accepts, e.g. c2.envs.sandbox.workspace_parent()), tests `run_subprocess`.
  """
  root = pathlib.Path(workspace_root)
  graded = root if in_place else pathlib.Path(tempfile.mkdtemp(prefix="c2-grade-",
                                                                dir=scratch_dir))
  try:
    if not in_place:
      shutil.copytree(root, graded, dirs_exist_ok=True, symlinks=True)
    write_files(graded, task.hidden_files)  # hidden versions win over the policy's edits
    exit_code, output = run_command_fn(task.test_command, graded)
  finally:
    if not in_place:
      shutil.rmtree(graded, ignore_errors=True)
  outcomes = parse_test_output(output)
  names = list(task.test_names) or list(outcomes)
  passed = sum(outcome_of(n, outcomes) == PASSED for n in names)
  return GradeResult(reward=task_reward(outcomes, task.test_names, mode), passed=passed,
                     total=len(names), outcomes=outcomes, output=output, exit_code=exit_code)


def run_subprocess(command: str, workspace_root: str | os.PathLike, *,
                   timeout_s: float = 60.0) -> tuple[int, str]:
  """Runs a shell command in workspace_root with no sandbox: for trusted code only (tests, the
  oracle). `python` resolves to this interpreter; no bytecode is written into the workspace."""
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
             PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
  try:
    proc = subprocess.run(command, shell=True, cwd=workspace_root, env=env, timeout=timeout_s,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace")
  except subprocess.TimeoutExpired as e:
    output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
    return 124, output + f"\n[timed out after {timeout_s:g} s]"
  return proc.returncode, proc.stdout
