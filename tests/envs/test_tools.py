"""The coding tools on a small workspace: each tool's output, argument checks, path safety (symlinks
the agent makes with `run` included) and the output cap."""
import os

import pytest

from c2.envs.tools import ALL_TOOLS, ToolConfig, ToolError, Tools, check_arguments
from c2.envs.workspace import Workspace

LINES = "".join(f"line{i}\n" for i in range(1, 11))  # 10 lines
FILES = {"lines.txt": LINES, "app.py": "x = 1\ny = 1\n\ndef f():\n  return x + y\n",
         "pkg/__init__.py": "", "pkg/mod.py": "def helper():\n  return 'needle'\n",
         "empty.txt": ""}
SECRET = "TOPSECRET-42\n"


@pytest.fixture
def ws():
  with Workspace.create(FILES) as w:
    yield w


@pytest.fixture
def tools(ws):
  return Tools(ws)


@pytest.fixture
def outside(tmp_path):
  """A directory outside the workspace holding a planted file; checked intact afterwards."""
  (tmp_path / "secret.txt").write_text(SECRET)
  yield tmp_path
  assert sorted(os.listdir(tmp_path)) == ["secret.txt"]
  assert (tmp_path / "secret.txt").read_text() == SECRET


# ---- read_file ---------------------------------------------------------------------------------

def test_read_file_numbers_lines_and_takes_a_range(tools):
  assert tools.call("read_file", {"path": "app.py"}) == (
      "    1\tx = 1\n    2\ty = 1\n    3\t\n    4\tdef f():\n    5\t  return x + y")
  assert tools.call("read_file", {"path": "lines.txt", "start_line": 3, "end_line": 5}) == (
      "    3\tline3\n    4\tline4\n    5\tline5\n[lines 6-10 not shown]")
  assert tools.call("read_file", {"path": "lines.txt", "start_line": 9}) == (
      "    9\tline9\n   10\tline10")
  assert tools.call("read_file", {"path": "empty.txt"}) == "(empty file)"


def test_read_file_stops_at_the_line_cap_and_says_so(ws):
  tools = Tools(ws, ToolConfig(max_read_lines=4))
  assert tools.call("read_file", {"path": "lines.txt"}) == (
      "    1\tline1\n    2\tline2\n    3\tline3\n    4\tline4\n[lines 5-10 not shown]")
  # The cap counts from start_line, and end_line beyond the cap does not lift it.
  assert tools.call("read_file", {"path": "lines.txt", "start_line": 6, "end_line": 10}) == (
      "    6\tline6\n    7\tline7\n    8\tline8\n    9\tline9\n[lines 10-10 not shown]")


def test_read_file_refuses_directories_and_missing_files(tools):
  with pytest.raises(ToolError, match="'pkg' is not a file"):
    tools.call("read_file", {"path": "pkg"})
  with pytest.raises(ToolError, match="read_file: FileNotFoundError: 'nope.py' does not exist"):
    tools.call("read_file", {"path": "nope.py"})


# ---- edit_file / write_file --------------------------------------------------------------------

def test_edit_file_replaces_the_one_occurrence(tools, ws):
  assert tools.call("edit_file", {"path": "app.py", "search": "x + y", "replace": "x * y"}) == (
      "edited app.py")
  assert (ws.root / "app.py").read_text() == "x = 1\ny = 1\n\ndef f():\n  return x * y\n"
  assert tools.code_written == ["x * y"]


def test_edit_file_errors_say_how_to_fix_the_call(tools, ws):
  with pytest.raises(ToolError, match="does not occur in app.py; read the file and copy the "
                                      r"text exactly \(whitespace included\)"):
    tools.call("edit_file", {"path": "app.py", "search": "x  = 1", "replace": "x = 2"})
  with pytest.raises(ToolError, match="occurs 2 times in app.py; include more surrounding lines"):
    tools.call("edit_file", {"path": "app.py", "search": " = 1", "replace": " = 2"})
  with pytest.raises(ToolError, match="`search` is empty"):
    tools.call("edit_file", {"path": "app.py", "search": "", "replace": "z"})
  with pytest.raises(ToolError, match="`search` and `replace` are identical, so nothing would "
                                      "change; put the new text in `replace`"):
    tools.call("edit_file", {"path": "app.py", "search": "x + y", "replace": "x + y"})
  assert (ws.root / "app.py").read_text() == FILES["app.py"]
  assert tools.code_written == []


def test_write_file_creates_directories_and_overwrites(tools, ws):
  assert tools.call("write_file", {"path": "new/deep/mod.py", "content": "é = 1\n"}) == (
      "wrote 7 bytes to new/deep/mod.py")  # bytes, not characters
  assert (ws.root / "new/deep/mod.py").read_text() == "é = 1\n"
  tools.call("write_file", {"path": "app.py", "content": "pass\n"})
  assert (ws.root / "app.py").read_text() == "pass\n"
  assert tools.code_written == ["é = 1\n", "pass\n"]
  with pytest.raises(ToolError, match="'pkg' is a directory"):
    tools.call("write_file", {"path": "pkg", "content": "x"})


def test_write_file_size_limit(ws):
  tools = Tools(ws, ToolConfig(max_write_bytes=10))
  with pytest.raises(ToolError, match="content exceeds 10 bytes"):
    tools.call("write_file", {"path": "big.txt", "content": "x" * 11})
  assert not (ws.root / "big.txt").exists()
  assert tools.call("write_file", {"path": "ok.txt", "content": "x" * 10}) == (
      "wrote 10 bytes to ok.txt")


# ---- list_dir / grep ---------------------------------------------------------------------------

def test_list_dir(tools, ws):
  assert tools.call("list_dir", {}) == "app.py\nempty.txt\nlines.txt\npkg/"
  assert tools.call("list_dir", {"path": "pkg"}) == "__init__.py\nmod.py"
  (ws.root / "hollow").mkdir()
  assert tools.call("list_dir", {"path": "hollow"}) == "(empty directory)"
  with pytest.raises(ToolError, match="'app.py' is not a directory"):
    tools.call("list_dir", {"path": "app.py"})


def test_grep_matches_no_matches_and_bad_regex(tools, ws):
  assert tools.call("grep", {"pattern": r"return \S"}) == (
      "app.py:5:   return x + y\npkg/mod.py:2:   return 'needle'")
  assert tools.call("grep", {"pattern": "needle", "path": "pkg/mod.py"}) == (
      "pkg/mod.py:2:   return 'needle'")
  assert tools.call("grep", {"pattern": "line1$", "path": "."}) == "lines.txt:1: line1"
  assert tools.call("grep", {"pattern": "haystack"}) == "no matches"
  with pytest.raises(ToolError, match="grep: bad regular expression"):
    tools.call("grep", {"pattern": "(unclosed"})
  (ws.root / "blob.bin").write_bytes(b"\xff\xfeline\x00")  # not UTF-8: skipped like grep -I
  assert tools.call("grep", {"pattern": "^line1"}) == "lines.txt:1: line1\nlines.txt:10: line10"


def test_grep_stops_at_max_matches(ws):
  tools = Tools(ws, ToolConfig(max_grep_matches=3))
  assert tools.call("grep", {"pattern": "line", "path": "lines.txt"}) == (
      "lines.txt:1: line1\nlines.txt:2: line2\nlines.txt:3: line3\n[stopped at 3 matches]")


# ---- run / todo_write / finish -----------------------------------------------------------------

def test_run_returns_output_and_exit_code(tools, ws):
  assert tools.call("run", {"command": "cat app.py | head -1; echo oops >&2; exit 3"}) == (
      "x = 1\noops\n[exit code 3]")
  assert tools.call("run", {"command": "echo made > made.txt && ls pkg"}) == (
      "__init__.py\nmod.py\n[exit code 0]")
  assert (ws.root / "made.txt").read_text() == "made\n"
  assert tools.run_seconds > 0


def test_run_sees_an_edit_that_keeps_the_file_size(tools, ws):
  """A .pyc written by one run would shadow a same-size edit made within the same second."""
  (ws.root / "m.py").write_text("X = 'aaaa'\n")
  command = {"command": "python -c 'import m; print(m.X)'"}
  assert tools.call("run", command) == "aaaa\n[exit code 0]"
  tools.call("edit_file", {"path": "m.py", "search": "aaaa", "replace": "bbbb"})
  assert tools.call("run", command) == "bbbb\n[exit code 0]"
  assert not (ws.root / "__pycache__").exists()


def test_run_refuses_a_nul_byte(tools):
  with pytest.raises(ToolError, match="run: the command contains a NUL byte"):
    tools.call("run", {"command": "echo a\0b"})


def test_todo_write_counts_created_and_open_items(tools):
  assert tools.call("todo_write", {"items": [{"content": "read", "status": "completed"},
                                             {"content": "edit", "status": "in_progress"},
                                             {"content": "test"}]}) == (
      "[completed] read\n[in_progress] edit\n[pending] test")
  assert (tools.todos_created, tools.open_todos) == (3, 2)
  # Rewriting keeps known items; only new contents count as created.
  tools.call("todo_write", {"items": [{"content": "edit", "status": "completed"},
                                      {"content": "test", "status": "completed"},
                                      {"content": "docs", "status": "pending"}]})
  assert (tools.todos_created, tools.open_todos) == (4, 1)
  assert tools.todos[-1] == {"content": "docs", "status": "pending"}
  assert tools.call("todo_write", {"items": []}) == "(empty list)"
  assert (tools.todos_created, tools.open_todos) == (4, 0)
  with pytest.raises(ToolError, match=r"items\[1\]\.status 'done' is not one of"):
    tools.call("todo_write", {"items": [{"content": "a"}, {"content": "b", "status": "done"}]})
  with pytest.raises(ToolError, match=r"items\[0\] must be an object with a string 'content'"):
    tools.call("todo_write", {"items": ["a"]})
  assert tools.todos == []  # a refused call changes nothing


def test_finish_returns_its_message(tools):
  assert tools.call("finish", {"message": "All done."}) == "All done."


# ---- argument checks ---------------------------------------------------------------------------

def test_argument_checks():
  config = ToolConfig()
  with pytest.raises(ToolError, match="unknown tool 'delete_file'; available: read_file, "):
    check_arguments("delete_file", {}, config)
  with pytest.raises(ToolError, match="read_file: missing argument\\(s\\) path"):
    check_arguments("read_file", {"start_line": 1}, config)
  with pytest.raises(ToolError, match="argument 'start_line' must be a integer, got str"):
    check_arguments("read_file", {"path": "a", "start_line": "3"}, config)
  with pytest.raises(ToolError, match="argument 'start_line' must be a integer, got bool"):
    check_arguments("read_file", {"path": "a", "start_line": True}, config)
  with pytest.raises(ToolError, match="argument 'items' must be a array, got dict"):
    check_arguments("todo_write", {"items": {"content": "a"}}, config)
  with pytest.raises(ToolError, match="arguments must be a JSON object, got list"):
    check_arguments("read_file", ["a"], config)
  with pytest.raises(ToolError, match="unknown argument\\(s\\) mode; takes path, start_line"):
    check_arguments("read_file", {"path": "a", "mode": "r"}, config)
  lenient = ToolConfig(strict_arguments=False)
  assert check_arguments("read_file", {"path": "a", "mode": "r"}, lenient) == {"path": "a"}
  assert check_arguments("read_file", {"path": "a", "end_line": 4}, config) == {
      "path": "a", "end_line": 4}


def test_lone_surrogates_are_refused_before_any_tool_runs(tools, ws):
  # json.loads('"\\ud800"') gives a str that cannot be written to a file, a pipe or a path.
  for name, arguments in [("write_file", {"path": "s.txt", "content": "\ud800"}),
                          ("read_file", {"path": "\ud800"}),
                          ("todo_write", {"items": [{"content": "\ud83d"}]})]:
    with pytest.raises(ToolError, match="lone surrogate"):
      tools.call(name, arguments)
  assert not (ws.root / "s.txt").exists() and tools.todos == []


def test_unknown_arguments_ignored_when_not_strict(ws):
  tools = Tools(ws, ToolConfig(strict_arguments=False))
  assert tools.call("read_file", {"path": "lines.txt", "end_line": 1, "verbose": True}) == (
      "    1\tline1\n[lines 2-10 not shown]")
  with pytest.raises(ToolError, match="unknown argument"):
    Tools(ws).call("read_file", {"path": "lines.txt", "verbose": True})


def test_tool_config_enables_a_subset(ws):
  config = ToolConfig(enabled=("read_file", "finish"))
  assert [s["function"]["name"] for s in config.schemas()] == ["read_file", "finish"]
  assert [s["function"]["name"] for s in ToolConfig().schemas()] == list(ALL_TOOLS)
  tools = Tools(ws, config)
  with pytest.raises(ToolError, match="tool 'run' is not available here; available: "
                                      "read_file, finish"):
    tools.call("run", {"command": "touch ran.txt"})
  assert not (ws.root / "ran.txt").exists()
  assert tools.call("read_file", {"path": "app.py", "end_line": 1}).startswith("    1\tx = 1")


def test_tool_config_validation():
  with pytest.raises(ValueError, match="must include 'finish'"):
    ToolConfig(enabled=("read_file", "edit_file"))
  with pytest.raises(ValueError, match="unknown tools \\['rm'\\]"):
    ToolConfig(enabled=("rm", "finish"))


# ---- path safety -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, arguments", [
    ("read_file", {"path": "/etc/passwd"}),
    ("edit_file", {"path": "/etc/passwd", "search": "root", "replace": "toor"}),
    ("write_file", {"path": "/tmp/c2-escape.txt", "content": "x"}),
    ("list_dir", {"path": "/"}),
    ("grep", {"pattern": "root", "path": "/etc"}),
])
def test_absolute_paths_are_refused(tools, name, arguments):
  with pytest.raises(ToolError, match=f"{name}: path .* absolute paths are not allowed"):
    tools.call(name, arguments)
  assert not os.path.exists("/tmp/c2-escape.txt")


def test_dotdot_is_refused(tools, ws, outside):
  escape = os.path.relpath(outside / "secret.txt", ws.root)  # ../../...: a real way out
  assert escape.startswith("..")
  calls = [("read_file", {"path": escape}), ("read_file", {"path": "pkg/../app.py"}),
           ("edit_file", {"path": escape, "search": "TOP", "replace": "BOTTOM"}),
           ("write_file", {"path": os.path.join(os.path.dirname(escape), "new.txt"),
                           "content": "x"}),
           ("list_dir", {"path": ".."}), ("grep", {"pattern": "TOP", "path": escape})]
  for name, arguments in calls:
    with pytest.raises(ToolError, match="'..' is not allowed"):
      tools.call(name, arguments)


def test_symlinks_made_by_run_lead_nowhere(tools, ws, outside):
  """The agent links to outside through the shell; no file tool reads or writes through it."""
  assert tools.call("run", {"command": f"ln -s /etc/passwd passwd && ln -s {outside} outdir && "
                                       f"ln -s {outside / 'secret.txt'} leak && "
                                       "ln -s app.py inside && echo linked"}) == (
      "linked\n[exit code 0]")
  assert os.path.islink(ws.root / "leak") and os.path.islink(ws.root / "outdir")
  through = "leads through a symlink to .*, outside the workspace"
  refused = [
      ("read_file", {"path": "passwd"}), ("read_file", {"path": "leak"}),
      ("read_file", {"path": "outdir/secret.txt"}),
      ("edit_file", {"path": "leak", "search": "TOPSECRET", "replace": "x"}),
      ("edit_file", {"path": "outdir/secret.txt", "search": "TOPSECRET", "replace": "x"}),
      ("write_file", {"path": "leak", "content": "overwritten"}),
      ("write_file", {"path": "outdir/new.txt", "content": "planted"}),
      ("write_file", {"path": "outdir/sub/new.txt", "content": "planted"}),
      ("list_dir", {"path": "outdir"}),
      ("grep", {"pattern": "TOPSECRET", "path": "outdir"}),
      ("grep", {"pattern": "TOPSECRET", "path": "leak"}),
      ("grep", {"pattern": "root", "path": "passwd"}),
  ]
  for name, arguments in refused:
    with pytest.raises(ToolError, match=f"{name}: path .* {through}"):
      tools.call(name, arguments)
  # A grep over the whole tree does not follow the links either (it refuses, or skips them).
  try:
    whole = tools.call("grep", {"pattern": "TOPSECRET|root:"})
  except ToolError as e:
    whole = str(e)
  assert "TOPSECRET-42" not in whole and "root:x" not in whole
  # A link that stays inside is an ordinary path.
  assert tools.call("read_file", {"path": "inside", "end_line": 1}).startswith("    1\tx = 1")
  assert "leak" in tools.call("list_dir", {}).splitlines()
  # (the `outside` fixture checks that the planted directory is exactly as it was)


# ---- output cap --------------------------------------------------------------------------------

def test_output_is_cut_with_a_marker(ws):
  full = Tools(ws).call("read_file", {"path": "lines.txt"})
  tools = Tools(ws, ToolConfig(max_tool_output_chars=30))
  assert tools.call("read_file", {"path": "lines.txt"}) == (
      full[:30] + f"\n[... {len(full) - 30} characters cut ...]")
  assert tools.call("finish", {"message": "y" * 30}) == "y" * 30  # at the limit: untouched
  assert tools.call("run", {"command": "printf 'z%.0s' $(seq 100)"}) == (
      "z" * 30 + "\n[... 83 characters cut ...]")  # 100 z + "[exit code 0]": 113 characters
