"""Grading: output parsing (unittest verbose, pytest -rA/-v), the task reward, `grade`."""
import pathlib

import pytest

from c2.envs import grading, tasks

# Real Python 3.11 `python -m unittest -v` output: a docstring line, an expected failure, a
# subTest failure (the test's own line never gets a status), a skip.
UNITTEST_OUTPUT = """\
test_a (tests.test_hidden.T.test_a)
Doc line. ... ok
test_b (tests.test_hidden.T.test_b) ... ERROR
test_c (tests.test_hidden.T.test_c) ... expected failure
test_d (tests.test_hidden.T.test_d) ...
  test_d (tests.test_hidden.T.test_d) (i=1) ... FAIL
test_e (tests.test_hidden.T.test_e) ... skipped 'not today'
test_f (tests.test_hidden.T.test_f) ... ok

======================================================================
ERROR: test_b (tests.test_hidden.T.test_b)
----------------------------------------------------------------------
AttributeError: module 'pkg.mod' has no attribute 'g'

======================================================================
FAIL: test_d (tests.test_hidden.T.test_d) (i=1)
----------------------------------------------------------------------
AssertionError: 1 != 0

----------------------------------------------------------------------
Ran 6 tests in 0.001s

FAILED (failures=1, errors=1, expected failures=1, skipped=1)
"""

PYTEST_RA_OUTPUT = """\
============================= test session starts ==============================
collected 4 items

tests/test_x.py .F.s                                                     [100%]

=========================== short test summary info ============================
PASSED tests/test_x.py::test_one
PASSED tests/test_x.py::test_param[a b]
FAILED tests/test_x.py::test_two - AssertionError: assert 1 == 2
SKIPPED [1] tests/test_x.py:12: no network
XFAIL tests/test_x.py::test_known - reason
ERROR tests/test_broken.py - ModuleNotFoundError: No module named 'nope'
========================= 1 failed, 2 passed in 0.05s ==========================
"""

PYTEST_V_OUTPUT = """\
tests/test_y.py::test_alpha PASSED                                       [ 50%]
tests/test_y.py::TestK::test_beta FAILED                                 [100%]
"""


def test_parse_unittest_verbose():
  out = grading.parse_test_output(UNITTEST_OUTPUT)
  prefix = "tests.test_hidden.T."
  assert out == {prefix + "test_a": "passed", prefix + "test_b": "error",
                 prefix + "test_c": "passed", prefix + "test_d": "failed",
                 prefix + "test_e": "skipped", prefix + "test_f": "passed"}


def test_parse_pytest_summary_and_verbose():
  out = grading.parse_test_output(PYTEST_RA_OUTPUT + PYTEST_V_OUTPUT)
  assert out["tests/test_x.py::test_one"] == "passed"
  assert out["tests/test_x.py::test_two"] == "failed"
  assert out["tests/test_x.py::test_known"] == "passed"  # XFAIL counts as passing (SWE-bench)
  assert out["tests/test_broken.py"] == "error"
  assert out["tests/test_y.py::test_alpha"] == "passed"
  assert out["tests/test_y.py::TestK::test_beta"] == "failed"
  # Parametrised ids with spaces are cut at the space; counted names must match what pytest
  # prints, which SWE-bench's lists do for the ids they contain.
  assert "tests/test_x.py::test_param[a" in out


def test_task_reward_modes_and_missing_tests():
  outcomes = grading.parse_test_output(UNITTEST_OUTPUT)
  counted = ["tests.test_hidden.T.test_a", "tests.test_hidden.T.test_f",
             "tests.test_hidden.T.test_b", "tests.test_hidden.T.test_missing"]
  assert grading.task_reward(outcomes, counted) == 0.5
  assert grading.task_reward(outcomes, counted, mode="binary") == 0.0
  assert grading.task_reward(outcomes, counted[:2], mode="binary") == 1.0
  assert grading.task_reward(outcomes, []) == pytest.approx(3 / 6)  # every reported test
  assert grading.task_reward({}, []) == 0.0
  assert grading.task_reward({}, counted) == 0.0  # the command did not run at all
  with pytest.raises(ValueError, match="mode"):
    grading.task_reward(outcomes, counted, mode="partial")


def test_old_style_unittest_names_are_normalized():
  outcomes = grading.parse_test_output(UNITTEST_OUTPUT)
  assert grading.normalize_test_name("test_a (tests.test_hidden.T)") == "tests.test_hidden.T.test_a"
  assert grading.task_reward(outcomes, ["test_a (tests.test_hidden.T)"]) == 1.0
  # Python < 3.11 prints the class only: the same canonical name results.
  old = grading.parse_test_output("test_a (tests.test_hidden.T) ... ok\n")
  assert old == {"tests.test_hidden.T.test_a": "passed"}


def test_worst_outcome_wins_and_failed_imports_fail_their_tests():
  forged = "test_b (tests.test_hidden.T.test_b) ... ok\n" + UNITTEST_OUTPUT
  assert grading.parse_test_output(forged)["tests.test_hidden.T.test_b"] == "error"
  discover_failure = ("tests.test_hidden (unittest.loader._FailedTest.tests.test_hidden) ... "
                      "ERROR\n")
  fake = "test_a (tests.test_hidden.T.test_a) ... ok\n"
  outcomes = grading.parse_test_output(fake + discover_failure)
  assert grading.task_reward(outcomes, ["tests.test_hidden.T.test_a"]) == 0.0
  named_failure = "test_hidden (unittest.loader._FailedTest.test_hidden) ... ERROR\n"
  outcomes = grading.parse_test_output(fake + named_failure)
  assert grading.task_reward(outcomes, ["tests.test_hidden.T.test_a"]) == 0.0
  outcomes = grading.parse_test_output("PASSED tests/test_broken.py::test_z\n" + PYTEST_RA_OUTPUT)
  assert grading.task_reward(outcomes, ["tests/test_broken.py::test_z"]) == 0.0


def _task(**overrides):
  hidden = ("import unittest\n\nfrom pkg import mod\n\n\nclass T(unittest.TestCase):\n"
            "    def test_one(self):\n        self.assertEqual(mod.f(), 1)\n\n"
            "    def test_two(self):\n        self.assertEqual(mod.f() + 1, 2)\n")
  fields = dict(task_id="t", prompt="p", files={"pkg/__init__.py": "", "tests/__init__.py": "",
                                                "pkg/mod.py": "def f():\n    return 0\n"},
                test_command="python -m unittest -v -b tests.test_hidden",
                hidden_files={"tests/test_hidden.py": hidden},
                test_names=("tests.test_hidden.T.test_one", "tests.test_hidden.T.test_two"))
  fields.update(overrides)
  return tasks.Task(**fields)


def test_grade_copies_the_workspace_by_default(tmp_path: pathlib.Path):
  task = _task()
  tasks.write_workspace(task, tmp_path)
  result = grading.grade(task, tmp_path, grading.run_subprocess)
  assert (result.reward, result.passed, result.total) == (0.0, 0, 2)
  assert result.exit_code != 0 and "FAIL" in result.output
  assert not (tmp_path / "tests" / "test_hidden.py").exists()  # the workspace is untouched

  (tmp_path / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
  (tmp_path / "tests" / "test_hidden.py").write_text("raise SystemExit('policy-written')\n")
  result = grading.grade(task, tmp_path, grading.run_subprocess)
  assert (result.reward, result.passed, result.exit_code) == (1.0, 2, 0)  # hidden version wins


def test_grade_in_place_and_broken_code(tmp_path: pathlib.Path):
  task = _task()
  tasks.write_workspace(task, tmp_path)
  (tmp_path / "pkg" / "mod.py").write_text("def f(:\n")  # import fails: nothing runs
  result = grading.grade(task, tmp_path, grading.run_subprocess, in_place=True)
  assert result.reward == 0.0 and result.outcomes == {} and result.exit_code != 0
  assert (tmp_path / "tests" / "test_hidden.py").exists()


def test_grade_binary_mode_and_runner_timeout(tmp_path: pathlib.Path):
  task = _task()
  tasks.write_workspace(task, tmp_path)
  (tmp_path / "pkg" / "mod.py").write_text("def f():\n    return 1 if False else 0\n")
  assert grading.grade(task, tmp_path, grading.run_subprocess, mode="binary").reward == 0.0
  code, output = grading.run_subprocess("sleep 5", tmp_path, timeout_s=0.2)
  assert code == 124 and "timed out" in output
