"""Coding tasks: the JSONL task format, workspaces on disk, and SWE-bench-style local instances.

A task is what one agentic RL episode starts from: a workspace (inline `files`, or a repository
snapshot at `files_path`: a folder, .tar or .tar.gz), the user's `prompt`, and how it is graded:
`hidden_files` (tests the policy never sees) are written into the workspace only at grading, then
`test_command` runs and `test_names` are the tests that count (c2/envs/grading.py).

JSONL format, one task per line (only task_id and prompt are required):
  {"task_id": "rename-train-1a2b", "prompt": "Rename ...", "files": {"pkg/a.py": "..."},
   "files_path": null, "test_command": "python -m unittest -v tests.test_hidden",
   "hidden_files": {"tests/test_hidden.py": "..."}, "visible_test_command": "python -m unittest -v",
   "tags": ["level:1", "kind:rename_symbol"], "level": 1, "split": "train",
   "solution": [{"name": "edit_file", "arguments": {"path": "...", "search": "...",
                                                     "replace": "..."}}],
   "test_names": ["tests.test_hidden.TestRename.test_new_name"]}
A relative files_path is read relative to the JSONL file's folder. `solution` is the oracle's tool
calls (TOOL_ARGUMENTS below is their vocabulary); external tasks leave it empty.

SWE-bench-style directory (`load_swebench_dir`), for bringing real task sets:
  <dir>/instances.jsonl   one SWE-bench record per line: instance_id, problem_statement,
                          test_patch, FAIL_TO_PASS, PASS_TO_PASS (JSON lists, or JSON text of
                          lists as in the Hugging Face dataset), optional repo and test_command
  <dir>/repos/<instance_id>/ or repos/<instance_id>.tar[.gz|.tgz]   the snapshot at base_commit
The test patch is applied here, in Python, to the snapshot's files; the patched test files become
the hidden files. FAIL_TO_PASS + PASS_TO_PASS become the counted tests, and the default command
runs pytest with `-rA` on the patched files (set test_command per record for other runners).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import pathlib
import re
import shlex
import shutil
import tarfile
from typing import Any, Callable, Iterable, Mapping, Optional

# Tool-call vocabulary of the coding environments: name -> (required, optional) argument names.
TOOL_ARGUMENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "read_file": (("path",), ()),
    "edit_file": (("path", "search", "replace"), ()),  # search must occur exactly once
    "write_file": (("path", "content"), ()),
    "list_dir": ((), ("path",)),
    "grep": (("pattern",), ("path",)),
    "run": (("command",), ()),
    "finish": (("message",), ()),
}
SPLITS = ("train", "heldout")
_TARBALL_SUFFIXES = (".tar", ".tar.gz", ".tgz")


class TaskFormatError(ValueError):
  """A task file or directory that cannot be read; the message names file, line and field."""


def check_relative_path(path: str, field: str = "path") -> str:
  """Workspace paths are relative POSIX paths that stay inside the workspace (no '..')."""
  parts = pathlib.PurePosixPath(path).parts if isinstance(path, str) else ()
  if not parts or path.startswith("/") or ".." in parts or "\\" in path:
    raise ValueError(f"field {field!r}: {path!r} is not a relative path inside the workspace; "
                     "write it like 'pkg/module.py'")
  return str(pathlib.PurePosixPath(path))


def check_tool_call(call: Any, field: str = "solution") -> None:
  """Raises ValueError unless `call` is {"name": known tool, "arguments": {its arguments}}."""
  if not isinstance(call, Mapping) or set(call) != {"name", "arguments"}:
    raise ValueError(f"field {field!r}: a tool call is {{'name': ..., 'arguments': {{...}}}}, "
                     f"got {call!r:.120}")
  name, arguments = call["name"], call["arguments"]
  if name not in TOOL_ARGUMENTS:
    raise ValueError(f"field {field!r}: unknown tool {name!r}; the tools are "
                     f"{sorted(TOOL_ARGUMENTS)}")
  required, optional = TOOL_ARGUMENTS[name]
  if not isinstance(arguments, Mapping) or not set(required) <= set(arguments) <= {
      *required, *optional} or not all(isinstance(v, str) for v in arguments.values()):
    raise ValueError(f"field {field!r}: {name} takes string arguments {required} "
                     f"(optional {optional}), got {arguments!r:.120}")


@dataclasses.dataclass(frozen=True)
class Task:
  """One coding task; see the module docstring for the JSONL form of every field."""

  task_id: str
  prompt: str
  files: Mapping[str, str] = dataclasses.field(default_factory=dict)
  files_path: Optional[str] = None  # folder / .tar / .tar.gz snapshot; inline files overlay it
  test_command: str = "python -m unittest -v"  # verbose: grading reads per-test outcomes
  hidden_files: Mapping[str, str] = dataclasses.field(default_factory=dict)
  visible_test_command: Optional[str] = None  # what the prompt may tell the policy to run
  tags: tuple[str, ...] = ()  # e.g. ("level:1", "kind:set_constant")
  level: int = 0  # 0: unknown (external tasks)
  split: str = "train"
  solution: tuple[Mapping[str, Any], ...] = ()
  test_names: tuple[str, ...] = ()  # empty: every test the command reports counts

  def __post_init__(self):
    # JSON gives lists; tuples make tasks built either way compare equal.
    for name in ("tags", "solution", "test_names"):
      if isinstance(getattr(self, name), (str, Mapping)):
        raise ValueError(f"field {name!r}: must be a list, got {getattr(self, name)!r:.80}")
      object.__setattr__(self, name, tuple(getattr(self, name)))
    for name in ("task_id", "prompt", "test_command"):
      if not isinstance(getattr(self, name), str) or not getattr(self, name):
        raise ValueError(f"field {name!r}: must be a non-empty string")
    for name in ("files", "hidden_files"):
      mapping = getattr(self, name)
      if not isinstance(mapping, Mapping) or not all(isinstance(v, str) for v in mapping.values()):
        raise ValueError(f"field {name!r}: must map relative paths to file text")
      for path in mapping:
        check_relative_path(path, name)
    if self.split not in SPLITS:
      raise ValueError(f"field 'split': must be one of {SPLITS}, got {self.split!r}")
    if not isinstance(self.level, int) or self.level < 0:
      raise ValueError(f"field 'level': must be an int >= 0, got {self.level!r}")
    if not all(isinstance(t, str) for t in self.tags + self.test_names):
      raise ValueError("fields 'tags' and 'test_names': must be lists of strings")
    for call in self.solution:
      check_tool_call(call)

  @property
  def kind(self) -> Optional[str]:
    """The value of the "kind:..." tag, if any."""
    return next((t.split(":", 1)[1] for t in self.tags if t.startswith("kind:")), None)

  def to_json(self) -> dict[str, Any]:
    """The JSONL record (plain lists and dicts)."""
    record = dataclasses.asdict(self)
    record.update(files=dict(self.files), hidden_files=dict(self.hidden_files),
                  tags=list(self.tags), test_names=list(self.test_names),
                  solution=[{"name": c["name"], "arguments": dict(c["arguments"])}
                            for c in self.solution])
    return record

  @classmethod
  def from_json(cls, record: Any) -> Task:
    """Builds a task from a JSONL record; ValueError naming the field on anything wrong."""
    if not isinstance(record, Mapping):
      raise ValueError(f"a task is a JSON object, got {type(record).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in record:
      if key not in fields:
        close = difflib.get_close_matches(key, fields, n=1)
        raise ValueError(f"field {key!r}: unknown" + (f"; did you mean {close[0]!r}?" if close
                                                       else f"; the fields are {sorted(fields)}"))
    for key in ("task_id", "prompt"):
      if key not in record:
        raise ValueError(f"field {key!r}: missing; every task needs one")
    return cls(**record)


def _json_lines(path: pathlib.Path) -> Iterable[tuple[int, Any]]:
  if not path.is_file():
    raise TaskFormatError(f"{path}: no such file")
  with path.open(encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
        try:
          yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
          raise TaskFormatError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); "
                                "each line must hold one whole JSON object") from None


def read_jsonl(path: str | os.PathLike) -> list[Task]:
  """Reads tasks, one JSON object per non-blank line; errors name the file, line and field."""
  path = pathlib.Path(path)
  tasks = []
  for lineno, record in _json_lines(path):
    try:
      task = Task.from_json(record)
    except (TypeError, ValueError) as e:
      raise TaskFormatError(f"{path}:{lineno}: {e}") from None
    if task.files_path and not os.path.isabs(task.files_path):
      task = dataclasses.replace(task, files_path=str(path.parent / task.files_path))
    tasks.append(task)
  return tasks


def write_jsonl(tasks: Iterable[Task], path: str | os.PathLike) -> None:
  """Writes one JSON object per task and line (the format `read_jsonl` reads)."""
  with pathlib.Path(path).open("w", encoding="utf-8") as f:
    for task in tasks:
      f.write(json.dumps(task.to_json(), ensure_ascii=False) + "\n")


def _member_name(name: str) -> str:
  while name.startswith("./"):
    name = name[2:]
  return name


class Snapshot:
  """Read access to a repository snapshot: a folder or a tarball.

  A tarball whose members all sit under one top-level folder (as GitHub archives do) has that
  folder stripped, so paths are repository-relative either way.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    self._members: dict[str, tarfile.TarInfo] = {}
    self._is_tarball = self.path.is_file() and self.path.name.endswith(_TARBALL_SUFFIXES)
    if self._is_tarball:
      with tarfile.open(self.path) as tar:
        files = {_member_name(m.name): m for m in tar.getmembers() if m.isfile()}
      strip = len({n.split("/", 1)[0] for n in files}) == 1 and all("/" in n for n in files)
      for name, member in files.items():
        name = name.split("/", 1)[1] if strip else name
        self._members[check_relative_path(name, "files_path")] = member
    elif not self.path.is_dir():
      raise ValueError(f"field 'files_path': {self.path} is not a folder or a "
                       f"{'/'.join(_TARBALL_SUFFIXES)} tarball")

  def read(self, relpath: str) -> Optional[str]:
    """The file's text, or None if the snapshot has no such file."""
    relpath = check_relative_path(relpath)
    if not self._is_tarball:
      file = self.path / relpath
      return file.read_text(encoding="utf-8") if file.is_file() else None
    if relpath not in self._members:
      return None
    with tarfile.open(self.path) as tar:
      return tar.extractfile(self._members[relpath]).read().decode("utf-8")

  def copy_to(self, root: pathlib.Path) -> None:
    """Copies every file of the snapshot under root."""
    if not self._is_tarball:
      shutil.copytree(self.path, root, dirs_exist_ok=True, symlinks=True)
      return
    # Member by member, through check_relative_path: no link or '..' member can write outside.
    with tarfile.open(self.path) as tar:
      for relpath, member in self._members.items():
        target = root / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(tar.extractfile(member).read())
        if member.mode & 0o111:
          target.chmod(0o755)


def write_files(root: str | os.PathLike, files: Mapping[str, str]) -> None:
  """Writes path -> text into root, replacing whatever is in the way.

  The workspace may hold what a policy left there: a symlink on the path is removed rather than
  followed (it could point outside the workspace), and a file where a folder must go (or a
  folder where the file goes) is replaced, so hidden files always land where they belong.
  """
  for relpath in files:
    parts = pathlib.PurePosixPath(check_relative_path(relpath)).parts
    target = pathlib.Path(root)
    for depth, part in enumerate(parts, 1):
      target = target / part
      if target.is_symlink() or (depth < len(parts) and target.is_file()):
        target.unlink()
      elif depth == len(parts) and target.is_dir():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(files[relpath], encoding="utf-8")


def write_workspace(task: Task, root: str | os.PathLike) -> pathlib.Path:
  """Materialises the task's starting workspace (snapshot, then inline files) under root.

  Hidden files are not written: grading adds them (c2/envs/grading.py).
  """
  root = pathlib.Path(root)
  root.mkdir(parents=True, exist_ok=True)
  if task.files_path:
    Snapshot(task.files_path).copy_to(root)
  write_files(root, task.files)
  return root


class PatchError(ValueError):
  """A unified diff that does not apply exactly; the message names the file and hunk."""


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_UNSUPPORTED = ("rename from", "copy from", "Binary files", "GIT binary patch")


def _split_lines(text: str) -> list[str]:
  """Lines with their "\n" kept; only "\n" splits (str.splitlines would split on form feeds)."""
  parts = text.split("\n")
  return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _diff_path(header: str) -> Optional[str]:
  path = header.rstrip("\n").split("\t", 1)[0].strip().strip('"')
  if path == "/dev/null":
    return None
  return path[2:] if path.startswith(("a/", "b/")) else path  # git's -p1 prefixes


def parse_unified_diff(text: str) -> list[tuple[Optional[str], Optional[str], list]]:
  """[(old_path, new_path, hunks)], each hunk (old_start, old_len, [(tag, line)]); None: /dev/null.

  Hunk bodies are read by the line counts in their headers, so a removed line that starts with
  "--" cannot be mistaken for a file header.
  """
  lines, patches, i = _split_lines(text), [], 0
  while i < len(lines):
    line = lines[i]
    if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
      patches.append((_diff_path(line[4:]), _diff_path(lines[i + 1][4:]), []))
      i += 2
    elif match := _HUNK_HEADER.match(line):
      if not patches:
        raise PatchError(f"hunk {line.strip()!r} comes before any ---/+++ file header")
      old_start, old_len, _, new_len = (int(g) if g is not None else 1 for g in match.groups())
      body, old_left, new_left, i = [], old_len, new_len, i + 1
      while old_left > 0 or new_left > 0 or (i < len(lines) and lines[i].startswith("\\")):
        if i >= len(lines):
          raise PatchError(f"{patches[-1][1] or patches[-1][0]}: hunk {line.strip()!r} is cut "
                           "short (fewer lines than its header counts)")
        tag, content = (" ", "\n") if lines[i] == "\n" else (lines[i][:1], lines[i][1:])
        if tag == "\\":  # "\ No newline at end of file": the previous line has no "\n"
          body[-1] = (body[-1][0], body[-1][1].rstrip("\n"))
        elif tag in " -+":
          body.append((tag, content))
          old_left -= tag != "+"
          new_left -= tag != "-"
        else:
          raise PatchError(f"hunk {line.strip()!r}: line {lines[i]!r:.60} is not ' ', '-' or '+'")
        i += 1
      patches[-1][2].append((old_start, old_len, body))
    elif line.startswith(_UNSUPPORTED):
      raise PatchError(f"{line.strip()!r}: renames, copies and binary patches are not supported")
    else:
      i += 1  # diff --git, index and mode lines carry nothing the hunks do not
  return patches


def apply_unified_diff(text: str, read: Callable[[str], Optional[str]]
                       ) -> dict[str, Optional[str]]:
  """Applies a unified diff strictly: every hunk at its stated line, context matching exactly.

  read(path) -> the file's text or None if absent. Returns path -> new text (None: deleted).
  """
  results: dict[str, Optional[str]] = {}
  for old_path, new_path, hunks in parse_unified_diff(text):
    path = new_path or old_path
    if old_path and new_path and old_path != new_path:
      raise PatchError(f"{old_path} -> {new_path}: renames are not supported")
    before = results[path] if path in results else read(path)
    if (old_path is None) != (before is None):
      raise PatchError(f"{path}: the patch {'creates' if old_path is None else 'changes'} it, but "
                       f"it {'already exists' if old_path is None else 'does not exist'}")
    lines, out, pos = _split_lines(before or ""), [], 0
    for old_start, old_len, body in hunks:
      start = old_start if old_len == 0 else old_start - 1  # "-5,0": insert after line 5
      expected = [content for tag, content in body if tag != "+"]
      got = lines[start:start + len(expected)]
      if start < pos or got != expected:
        bad = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), len(got))
        want = expected[bad] if bad < len(expected) else ""
        found = got[bad] if bad < len(got) else "end of file"
        raise PatchError(f"{path}: hunk at line {old_start} does not match the file (line "
                         f"{start + bad + 1}: expected {want!r:.60}, found {found!r:.60})")
      out += lines[pos:start] + [content for tag, content in body if tag != "-"]
      pos = start + len(expected)
    results[path] = None if new_path is None else "".join(out + lines[pos:])
  return results


def _test_list(record: Mapping[str, Any], key: str) -> list[str]:
  value = record.get(key, [])
  if isinstance(value, str):  # the Hugging Face SWE-bench dataset stores these as JSON text
    value = json.loads(value) if value.strip() else []
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    raise ValueError(f"field {key!r}: must be a list of test names (or JSON text of one)")
  return value


def _find_snapshot(repos: pathlib.Path, instance_id: str) -> pathlib.Path:
  for candidate in [repos / instance_id] + [repos / (instance_id + s) for s in _TARBALL_SUFFIXES]:
    if candidate.exists():
      return candidate
  raise ValueError(f"field 'instance_id': no snapshot {repos / instance_id}/ or "
                   f"{repos / instance_id}.tar[.gz]; put the repository at base_commit there")


def load_swebench_dir(path: str | os.PathLike, *, split: str = "heldout") -> list[Task]:
  """Reads a local SWE-bench-style directory (layout in the module docstring) into tasks."""
  root = pathlib.Path(path)
  index = root / "instances.jsonl"
  tasks = []
  for lineno, record in _json_lines(index):
    try:
      for key in ("instance_id", "problem_statement", "test_patch"):
        if not isinstance(record.get(key), str) or not record[key]:
          raise ValueError(f"field {key!r}: missing or not a non-empty string")
      snapshot_path = _find_snapshot(root / "repos", record["instance_id"])
      try:
        patched = apply_unified_diff(record["test_patch"], Snapshot(snapshot_path).read)
      except PatchError as e:
        raise ValueError(f"field 'test_patch': {e}") from None
      if deleted := [p for p, text in patched.items() if text is None]:
        raise ValueError(f"field 'test_patch': deletes {deleted}; hidden files can only add or "
                         "replace files, so drop the deletion from the patch")
      test_files = sorted(p for p in patched if p.endswith(".py"))
      command = record.get("test_command") or " ".join(
          ["python -m pytest -rA -p no:cacheprovider"] + [shlex.quote(p) for p in test_files])
      tags = ("kind:swebench",) + ((f"repo:{record['repo']}",) if record.get("repo") else ())
      tasks.append(Task(
          task_id=record["instance_id"], prompt=record["problem_statement"],
          files_path=str(snapshot_path), test_command=command, hidden_files=patched, tags=tags,
          split=split, test_names=tuple(_test_list(record, "FAIL_TO_PASS")
                                        + _test_list(record, "PASS_TO_PASS"))))
    except (TypeError, ValueError) as e:
      raise TaskFormatError(f"{index}:{lineno}: {e}") from None
  return tasks


def apply_tool_calls(files: Mapping[str, str], calls: Iterable[Mapping[str, Any]],
                     ) -> dict[str, str]:
  """The file effects of edit_file/write_file calls on path -> text (other tools change nothing).

  A reference for the environment's tools and the way tests replay oracle solutions without a
  sandbox; raises ValueError where the real tool would report an error.
  """
  files = dict(files)
  for call in calls:
    args = call["arguments"]
    if call["name"] == "write_file":
      files[check_relative_path(args["path"])] = args["content"]
    elif call["name"] == "edit_file":
      text = files.get(args["path"])
      if text is None or text.count(args["search"]) != 1 or not args["search"]:
        found = "no such file" if text is None else f"{text.count(args['search'])} matches"
        raise ValueError(f"edit_file {args['path']}: search text must occur exactly once "
                         f"({found})")
      files[args["path"]] = text.replace(args["search"], args["replace"])
  return files

