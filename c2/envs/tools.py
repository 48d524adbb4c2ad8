"""The coding environment's tools: schemas (for the chat template), argument checks, execution.

  read_file(path, start_line?, end_line?)  numbered lines of a workspace file
  edit_file(path, search, replace)         replace the one occurrence of `search`
  write_file(path, content)                create or overwrite a file
  list_dir(path=".")                       entries of a directory (directories end with "/")
  grep(pattern, path=".")                  regex matches as path:line: text
  run(command)                             a shell command in the sandbox (c2/envs/sandbox.py)
  todo_write(items)                        the agent's to-do list: [{"content", "status"}]
  finish(message)                          end the rollout with a final message

The file tools run in this process, so every path goes through `Workspace.resolve`, which refuses
absolute paths, `..` and symlinks leading outside. A bad call raises `ToolError` with a message
the model can act on; the environment turns it into an error observation and counts it.
Which tools exist, and how strict the checks are, is per environment (`ToolConfig`): the report
removes tools and tightens argument checks per environment.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Mapping, Optional

from c2.envs import sandbox
from c2.envs.workspace import PathOutsideWorkspace, Workspace

TODO_STATUSES = ("pending", "in_progress", "completed")


class ToolError(ValueError):
  """A call the environment refuses; the message goes back to the model."""


def _schema(name: str, description: str, properties: dict, required: tuple = ()) -> dict:
  return {"type": "function", "function": {
      "name": name, "description": description,
      "parameters": {"type": "object", "properties": properties, "required": list(required)}}}


_STR = {"type": "string"}
_INT = {"type": "integer"}
SCHEMAS = {
    "read_file": _schema("read_file", "Read a file of the workspace, with line numbers.",
                         {"path": _STR, "start_line": _INT, "end_line": _INT}, ("path",)),
    "edit_file": _schema("edit_file", "Replace the single occurrence of `search` in a file by "
                         "`replace`. Fails if `search` is absent or occurs more than once.",
                         {"path": _STR, "search": _STR, "replace": _STR},
                         ("path", "search", "replace")),
    "write_file": _schema("write_file", "Create or overwrite a file with `content`.",
                          {"path": _STR, "content": _STR}, ("path", "content")),
    "list_dir": _schema("list_dir", "List a directory of the workspace.", {"path": _STR}),
    "grep": _schema("grep", "Search files for a regular expression.",
                    {"pattern": _STR, "path": _STR}, ("pattern",)),
    "run": _schema("run", "Run a shell command in the workspace (tests, scripts). No network.",
                   {"command": _STR}, ("command",)),
    "todo_write": _schema("todo_write", "Replace the to-do list. Statuses: pending, "
                          "in_progress, completed.",
                          {"items": {"type": "array", "items": {"type": "object", "properties": {
                              "content": _STR, "status": _STR}}}}, ("items",)),
    "finish": _schema("finish", "End the task with a final message to the user.",
                      {"message": _STR}, ("message",)),
}
ALL_TOOLS = tuple(SCHEMAS)
# No __pycache__ in the workspace: Python trusts a .pyc whose source has the same size and the same
# mtime in whole seconds, so an edit that keeps a file's size within a second of a test run would
# leave the old code running (in the agent's next run and in the grader's copy alike).
RUN_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
_PYTHON_TYPES = {"string": str, "integer": int, "array": list}


@dataclasses.dataclass(frozen=True)
class ToolConfig:
  """Per-environment tool set and limits."""
  enabled: tuple[str, ...] = ALL_TOOLS
  max_read_lines: int = 400  # read_file returns at most this many lines (and says so)
  max_tool_output_chars: int = 8000  # any tool's observation is cut here, with a marker
  max_grep_matches: int = 100
  max_write_bytes: int = 1 << 20
  strict_arguments: bool = True  # unknown argument names are errors (else ignored)
  run_limits: sandbox.SandboxLimits = sandbox.SandboxLimits()

  def __post_init__(self):
    unknown = set(self.enabled) - set(SCHEMAS)
    if unknown:
      raise ValueError(f"ToolConfig.enabled: unknown tools {sorted(unknown)}; known: {ALL_TOOLS}")
    if "finish" not in self.enabled:
      raise ValueError("ToolConfig.enabled must include 'finish' (the only way to end a rollout)")

  def schemas(self, descriptions: bool = True) -> list[dict]:
    """The enabled tools' JSON schemas; without descriptions (names, argument names and types
    only) the declaration is ~30% shorter, which matters for a small model on CPU that learned
    the tools from transcripts rather than from reading their documentation."""
    schemas = [SCHEMAS[name] for name in self.enabled]
    return schemas if descriptions else [_without_descriptions(s) for s in schemas]


def _without_descriptions(value: Any) -> Any:
  if isinstance(value, dict):
    return {k: _without_descriptions(v) for k, v in value.items() if k != "description"}
  if isinstance(value, list):
    return [_without_descriptions(v) for v in value]
  return value


def check_arguments(name: str, arguments: Any, config: ToolConfig) -> dict:
  """Validates a call's arguments against its schema; returns them as a dict or raises."""
  if name not in SCHEMAS:
    raise ToolError(f"unknown tool {name!r}; available: {', '.join(config.enabled)}")
  if name not in config.enabled:
    raise ToolError(f"tool {name!r} is not available here; available: {', '.join(config.enabled)}")
  if not isinstance(arguments, dict):
    raise ToolError(f"{name}: arguments must be a JSON object, got {type(arguments).__name__}")
  parameters = SCHEMAS[name]["function"]["parameters"]
  missing = [p for p in parameters["required"] if p not in arguments]
  if missing:
    raise ToolError(f"{name}: missing argument(s) {', '.join(missing)}")
  unknown = [a for a in arguments if a not in parameters["properties"]]
  if unknown and config.strict_arguments:
    raise ToolError(f"{name}: unknown argument(s) {', '.join(unknown)}; takes "
                    f"{', '.join(parameters['properties'])}")
  checked = {}
  for key, spec in parameters["properties"].items():
    if key in arguments:
      value = arguments[key]
      expected = _PYTHON_TYPES[spec["type"]]
      if not isinstance(value, expected) or isinstance(value, bool):
        raise ToolError(f"{name}: argument {key!r} must be a {spec['type']}, got "
                        f"{type(value).__name__}")
      checked[key] = value
  try:  # a JSON escape like "\ud800" (half an emoji pair) gives text no file or pipe can take
    json.dumps(checked, ensure_ascii=False, default=str).encode()
  except UnicodeEncodeError:
    raise ToolError(f"{name}: the arguments hold a lone surrogate (e.g. \\ud800), which is not "
                    "valid UTF-8 text") from None
  return checked


def _cut(text: str, limit: int) -> str:
  if len(text) <= limit:
    return text
  return text[:limit] + f"\n[... {len(text) - limit} characters cut ...]"


class Tools:
  """The tools over one workspace. `call` executes one checked call and returns its output."""

  def __init__(self, workspace: Workspace, config: ToolConfig = ToolConfig()):
    self.workspace, self.config = workspace, config
    self.todos: list[dict] = []
    self.todos_created = 0
    self.code_written: list[str] = []
    self.run_seconds = 0.0

  def call(self, name: str, arguments: Mapping[str, Any]) -> str:
    arguments = check_arguments(name, arguments, self.config)
    handler: Callable[..., str] = getattr(self, f"_{name}")
    try:
      return _cut(handler(**arguments), self.config.max_tool_output_chars)
    except PathOutsideWorkspace as e:
      raise ToolError(f"{name}: {e}") from None
    except (IsADirectoryError, NotADirectoryError, UnicodeDecodeError, OSError) as e:
      raise ToolError(f"{name}: {type(e).__name__}: {e}") from None

  # ---- file tools (in this process: paths always through Workspace.resolve) -------------------
  def _file(self, path: str):
    target = self.workspace.resolve(path, must_exist=True)
    if not target.is_file():
      raise ToolError(f"{path!r} is not a file")
    return target

  def _read_file(self, path: str, start_line: int = 1, end_line: Optional[int] = None) -> str:
    lines = self._file(path).read_text().splitlines()
    start = max(start_line, 1)
    end = min(len(lines), end_line or len(lines), start + self.config.max_read_lines - 1)
    body = "\n".join(f"{i:>5}\t{lines[i - 1]}" for i in range(start, end + 1))
    more = f"\n[lines {end + 1}-{len(lines)} not shown]" if end < len(lines) else ""
    return body + more if lines else "(empty file)"

  def _edit_file(self, path: str, search: str, replace: str) -> str:
    target = self._file(path)
    text = target.read_text()
    if not search:
      raise ToolError("edit_file: `search` is empty; give the exact text to replace")
    count = text.count(search)
    if count == 0:
      raise ToolError(f"edit_file: the search text does not occur in {path}; read the file and "
                      "copy the text exactly (whitespace included)")
    if count > 1:
      raise ToolError(f"edit_file: the search text occurs {count} times in {path}; include more "
                      "surrounding lines so that it is unique")
    if search == replace:
      # As real agent tools answer it (a no-op edit is a mistake, not a success): the commonest
      # failure of the tiny SFT policies is a replacement copied from its search text, which a
      # silent "edited" would let them finish on.
      raise ToolError("edit_file: `search` and `replace` are identical, so nothing would change; "
                      "put the new text in `replace`")
    target.write_text(text.replace(search, replace, 1))
    self.code_written.append(replace)
    return f"edited {path}"

  def _write_file(self, path: str, content: str) -> str:
    if len(content.encode()) > self.config.max_write_bytes:
      raise ToolError(f"write_file: content exceeds {self.config.max_write_bytes} bytes")
    target = self.workspace.resolve(path)
    if target.is_dir():
      raise ToolError(f"write_file: {path!r} is a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    self.code_written.append(content)
    return f"wrote {len(content.encode())} bytes to {path}"

  def _list_dir(self, path: str = ".") -> str:
    target = self.workspace.resolve(path, must_exist=True)
    if not target.is_dir():
      raise ToolError(f"list_dir: {path!r} is not a directory")
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
    return "\n".join(names) or "(empty directory)"

  def _grep(self, pattern: str, path: str = ".") -> str:
    try:
      regex = re.compile(pattern)
    except re.error as e:
      raise ToolError(f"grep: bad regular expression: {e}") from None
    target = self.workspace.resolve(path, must_exist=True)
    files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file())
    matches, root = [], self.workspace.root
    for file in files:
      self.workspace.resolve(str(file.relative_to(root)))  # no symlinked way out
      try:
        lines = file.read_text().splitlines()
      except (UnicodeDecodeError, OSError):
        continue  # binary files are skipped, as grep -I does
      for number, line in enumerate(lines, 1):
        if regex.search(line):
          matches.append(f"{file.relative_to(root)}:{number}: {line}")
          if len(matches) >= self.config.max_grep_matches:
            return "\n".join(matches) + f"\n[stopped at {len(matches)} matches]"
    return "\n".join(matches) or "no matches"

  # ---- the sandboxed command and the bookkeeping tools ----------------------------------------
  def _run(self, command: str) -> str:
    if "\0" in command:  # no process can take it as an argument
      raise ToolError("run: the command contains a NUL byte")
    result = sandbox.run_command(command, self.workspace.root, self.config.run_limits,
                                 env=RUN_ENV)
    self.run_seconds += result.wall_seconds
    status = f"[exit code {result.exit_code}"
    if result.timed_out or result.killed_by:
      status += f", {result.killed_by or 'timed out'}"
    return f"{result.output}{status}]"

  def _todo_write(self, items: list) -> str:
    todos = []
    for i, item in enumerate(items):
      if not isinstance(item, dict) or not isinstance(item.get("content"), str):
        raise ToolError(f"todo_write: items[{i}] must be an object with a string 'content'")
      status = item.get("status", "pending")
      if status not in TODO_STATUSES:
        raise ToolError(f"todo_write: items[{i}].status {status!r} is not one of {TODO_STATUSES}")
      todos.append({"content": item["content"], "status": status})
    known = {t["content"] for t in self.todos}
    self.todos_created += sum(t["content"] not in known for t in todos)
    self.todos = todos
    return "\n".join(f"[{t['status']}] {t['content']}" for t in todos) or "(empty list)"

  def _finish(self, message: str) -> str:
    return message

  @property
  def open_todos(self) -> int:
    return sum(t["status"] != "completed" for t in self.todos)
