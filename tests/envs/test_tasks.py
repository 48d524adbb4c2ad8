"""Tasks: the Task record, JSONL I/O and its errors, workspaces, the diff applier, SWE-bench."""
import json
import pathlib
import shutil
import subprocess
import tarfile

import pytest

from c2.envs import grading, tasks

EDIT = {"name": "edit_file", "arguments": {"path": "a.py", "search": "x = 1", "replace": "x = 2"}}


def make_task(**overrides):
  fields = dict(task_id="t1", prompt="Set x to 2.", files={"a.py": "x = 1\n"},
                hidden_files={"tests/test_hidden.py": "import unittest\n"},
                tags=("level:1", "kind:set_constant"), level=1, solution=(EDIT,),
                test_names=("tests.test_hidden.T.test_x",))
  fields.update(overrides)
  return tasks.Task(**fields)


def test_task_validation_names_the_field():
  assert make_task().kind == "set_constant"
  for overrides, field in [(dict(split="dev"), "split"),
                           (dict(files={"../escape.py": ""}), "files"),
                           (dict(hidden_files={"/abs.py": ""}), "hidden_files"),
                           (dict(level=-1), "level"), (dict(prompt=""), "prompt"),
                           (dict(tags="level:1"), "tags"),
                           (dict(solution=({"name": "delete_file", "arguments": {}},)), "solution"),
                           (dict(solution=({"name": "run", "arguments": {"cmd": "ls"}},)),
                            "solution")]:
    with pytest.raises(ValueError, match=f"field '{field}'"):
      make_task(**overrides)


def test_jsonl_round_trip_and_relative_snapshot(tmp_path: pathlib.Path):
  path = tmp_path / "tasks.jsonl"
  snapshot = make_task(task_id="t2", files={}, files_path="repos/t2", split="heldout")
  tasks.write_jsonl([make_task(), snapshot], path)
  first, second = tasks.read_jsonl(path)
  assert first == make_task()
  assert second.files_path == str(tmp_path / "repos" / "t2")  # relative to the JSONL's folder
  assert json.loads(path.read_text().splitlines()[0])["solution"] == [EDIT]


@pytest.mark.parametrize("line, message", [
    ('{"task_id": "a", "prompt": "p", "files": {"a.py": ""}, "promt": 1}',
     r"bad\.jsonl:2: field 'promt': unknown; did you mean 'prompt'\?"),
    ('{"task_id": "a", "files": {"a.py": ""}}', r"bad\.jsonl:2: field 'prompt': missing"),
    ('{"task_id": "a", "prompt": "p", "files": {"a.py": ""}, "split": "test"}',
     r"bad\.jsonl:2: field 'split': must be one of"),
    ('{"task_id": "a", "prompt": "p"', r"bad\.jsonl:2: not valid JSON"),
    ('["a list"]', r"bad\.jsonl:2: a task is a JSON object"),
])
def test_read_jsonl_errors_name_file_line_and_field(tmp_path: pathlib.Path, line, message):
  path = tmp_path / "bad.jsonl"
  good = json.dumps(make_task().to_json())
  path.write_text(good + "\n" + line + "\n")
  with pytest.raises(tasks.TaskFormatError, match=message):
    tasks.read_jsonl(path)


def test_write_workspace_from_inline_folder_and_tarball(tmp_path: pathlib.Path):
  repo = tmp_path / "repo"
  (repo / "pkg").mkdir(parents=True)
  (repo / "pkg" / "mod.py").write_text("A = 1\n")
  (repo / ".github").mkdir()
  (repo / ".github" / "ci.yml").write_text("on: push\n")
  tarball = tmp_path / "repo.tar.gz"
  with tarfile.open(tarball, "w:gz") as tar:
    tar.add(repo, arcname="project-abc123")  # one top-level folder, as GitHub archives have
  for source in (repo, tarball):
    task = make_task(files={"extra.py": "B = 2\n"}, files_path=str(source))
    root = tasks.write_workspace(task, tmp_path / f"ws-{source.name}")
    assert (root / "pkg" / "mod.py").read_text() == "A = 1\n"
    assert (root / ".github" / "ci.yml").exists()
    assert (root / "extra.py").read_text() == "B = 2\n"
    assert not (root / "tests" / "test_hidden.py").exists()
    assert tasks.Snapshot(source).read("pkg/mod.py") == "A = 1\n"
    assert tasks.Snapshot(source).read("missing.py") is None


def test_apply_tool_calls():
  files = tasks.apply_tool_calls({"a.py": "x = 1\n"}, [
      EDIT, {"name": "write_file", "arguments": {"path": "b/c.py", "content": "y\n"}},
      {"name": "run", "arguments": {"command": "rm -rf /"}}])  # run changes nothing here
  assert files == {"a.py": "x = 2\n", "b/c.py": "y\n"}
  with pytest.raises(ValueError, match="exactly once"):
    tasks.apply_tool_calls({"a.py": "x = 1\nx = 1\n"}, [EDIT])


BEFORE = "line 1\nline 2\nline 3\nline 4\nline 5\nline 6\nline 7\nline 8\nline 9\n"
AFTER = "line 1\nline 2 changed\nline 3\nline 4\nline 5\nline 6\nline 7\nline 8\nline 9\nline 10"
GIT_DIFF = """\
diff --git a/src/m.py b/src/m.py
index 1111111..2222222 100644
--- a/src/m.py
+++ b/src/m.py
@@ -1,3 +1,3 @@
 line 1
-line 2
+line 2 changed
 line 3
@@ -7,3 +7,4 @@ line 6
 line 7
 line 8
 line 9
+line 10
\\ No newline at end of file
diff --git a/tests/test_new.py b/tests/test_new.py
new file mode 100644
--- /dev/null
+++ b/tests/test_new.py
@@ -0,0 +1,2 @@
+--- not a header
+def test_new(): pass
diff --git a/old.txt b/old.txt
deleted file mode 100644
--- a/old.txt
+++ /dev/null
@@ -1 +0,0 @@
-bye
"""


def test_unified_diff_applies_modify_create_delete():
  files = {"src/m.py": BEFORE, "old.txt": "bye\n"}
  out = tasks.apply_unified_diff(GIT_DIFF, files.get)
  assert out == {"src/m.py": AFTER, "tests/test_new.py": "--- not a header\ndef test_new(): pass\n",
                 "old.txt": None}


def test_unified_diff_is_strict():
  with pytest.raises(tasks.PatchError, match=r"src/m.py: hunk at line 1 does not match .*line 2"):
    tasks.apply_unified_diff(GIT_DIFF, {"src/m.py": BEFORE.replace("line 2", "LINE 2"),
                                        "old.txt": "bye\n"}.get)
  with pytest.raises(tasks.PatchError, match="does not exist"):
    tasks.apply_unified_diff(GIT_DIFF, {}.get)
  with pytest.raises(tasks.PatchError, match="cut short"):
    tasks.apply_unified_diff("--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n a\n", {"x": "a\nb\n"}.get)
  with pytest.raises(tasks.PatchError, match="renames"):
    tasks.apply_unified_diff("diff --git a/x b/y\nrename from x\nrename to y\n", {}.get)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to produce a reference diff")
def test_unified_diff_matches_git(tmp_path: pathlib.Path):
  pairs = {"m.py": (BEFORE, AFTER), "n.py": ("a\n\fb\nc\n", "a\n\fb2\nc\nd\n"),
           "crlf.txt": ("one\r\ntwo\r\n", "one\r\n2\r\n")}
  for name, (before, after) in pairs.items():
    (tmp_path / "a").mkdir(exist_ok=True)
    (tmp_path / "b").mkdir(exist_ok=True)
    (tmp_path / "a" / name).write_bytes(before.encode())
    (tmp_path / "b" / name).write_bytes(after.encode())
  diff = subprocess.run(["git", "diff", "--no-index", "--no-color", "a", "b"], cwd=tmp_path,
                        capture_output=True).stdout.decode()
  # `git diff --no-index a b` writes paths as a/a/m.py and b/b/m.py; strip the folder names.
  diff = diff.replace("a/a/", "a/").replace("b/b/", "b/")
  out = tasks.apply_unified_diff(diff, {n: before for n, (before, _) in pairs.items()}.get)
  assert out == {n: after for n, (_, after) in pairs.items()}


def make_swebench_dir(root: pathlib.Path) -> None:
  """Two instances: a folder snapshot and a tarball; the test patch edits and adds a test file."""
  repo = root / "repos" / "demo__calc-1"
  (repo / "calc").mkdir(parents=True)
  (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return a - b\n")
  (repo / "tests").mkdir()
  (repo / "tests" / "test_calc.py").write_text(
      "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n")
  with tarfile.open(root / "repos" / "demo__calc-2.tar.gz", "w:gz") as tar:
    tar.add(repo, arcname="calc-main")
  patch = """\
diff --git a/tests/test_calc.py b/tests/test_calc.py
--- a/tests/test_calc.py
+++ b/tests/test_calc.py
@@ -3,3 +3,7 @@ from calc import add
 
 def test_zero():
     assert add(0, 0) == 0
+
+
+def test_add():
+    assert add(2, 3) == 5
"""
  records = [{"instance_id": f"demo__calc-{i}", "repo": "demo/calc", "problem_statement":
              "add() subtracts.", "test_patch": patch,
              "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
              "PASS_TO_PASS": ["tests/test_calc.py::test_zero"], "base_commit": "abc"}
             for i in (1, 2)]
  (root / "instances.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_load_swebench_dir_and_grade(tmp_path: pathlib.Path, monkeypatch):
  monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # this machine's plugins cost ~3 s
  make_swebench_dir(tmp_path)
  loaded = tasks.load_swebench_dir(tmp_path)
  assert [t.task_id for t in loaded] == ["demo__calc-1", "demo__calc-2"]
  first, second = loaded
  assert first.hidden_files == second.hidden_files
  assert first.hidden_files["tests/test_calc.py"].endswith("def test_add():\n"
                                                          "    assert add(2, 3) == 5\n")
  assert first.test_names == ("tests/test_calc.py::test_add", "tests/test_calc.py::test_zero")
  assert first.test_command == "python -m pytest -rA -p no:cacheprovider tests/test_calc.py"
  assert first.split == "heldout" and "repo:demo/calc" in first.tags and not first.solution

  workspace = tasks.write_workspace(second, tmp_path / "ws")
  result = grading.grade(second, workspace, grading.run_subprocess)
  assert (result.reward, result.passed, result.total) == (0.5, 1, 2), result.output[-2000:]
  (workspace / "calc" / "__init__.py").write_text("def add(a, b):\n    return a + b\n")
  assert grading.grade(second, workspace, grading.run_subprocess).reward == 1.0


def test_load_swebench_dir_errors(tmp_path: pathlib.Path):
  make_swebench_dir(tmp_path)
  shutil.rmtree(tmp_path / "repos" / "demo__calc-1")
  with pytest.raises(tasks.TaskFormatError, match=r"instances.jsonl:1: field 'instance_id': no "
                                                  "snapshot"):
    tasks.load_swebench_dir(tmp_path)
  record = {"instance_id": "demo__calc-2", "problem_statement": "p", "test_patch":
            "--- a/tests/test_calc.py\n+++ b/tests/test_calc.py\n@@ -1 +1 @@\n-nope\n+x\n"}
  (tmp_path / "instances.jsonl").write_text(json.dumps(record) + "\n")
  with pytest.raises(tasks.TaskFormatError, match="field 'test_patch': tests/test_calc.py: hunk"):
    tasks.load_swebench_dir(tmp_path)


def test_write_files_replaces_links_and_obstacles(tmp_path: pathlib.Path):
  outside = tmp_path / "outside.txt"
  outside.write_text("keep me")
  root = tmp_path / "ws"
  (root / "a").mkdir(parents=True)
  (root / "a" / "hidden.py").symlink_to(outside)  # a policy's link must not redirect the write
  (root / "b").write_text("a file where a folder goes")
  (root / "c.py").mkdir()  # a folder where the file goes
  (root / "d").symlink_to(tmp_path, target_is_directory=True)
  tasks.write_files(root, {"a/hidden.py": "1", "b/x.py": "2", "c.py": "3", "d/y.py": "4"})
  assert outside.read_text() == "keep me" and not (tmp_path / "y.py").exists()
  assert [(root / p).read_text() for p in ("a/hidden.py", "b/x.py", "c.py", "d/y.py")] == [
      "1", "2", "3", "4"]
  assert not (root / "a" / "hidden.py").is_symlink()
