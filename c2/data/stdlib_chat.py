"""The embedded SFT corpus: "implement this function" chats built from the stdlib's own source.

Every documented function or method of moderate size in the running interpreter's standard
library (c2/data/stdlib_corpus.py, same files and same train/heldout split) becomes one coding task:
  user       implement `name(signature)` of module M (method of class C), the docstring as spec;
  assistant  the definition, decorators included, in a ```python block.
About a quarter of the tasks (chosen by a stable hash) first look at the surrounding code, which
exercises the tool-call template (c2/data/chat.py):
  assistant  tool call `functions.read_file:0` {"path": "json/decoder.py", "around": "X.f"};
  tool       the lines around the definition, with the definition itself elided;
  assistant  the definition.
With the SFT pipeline's default `train_on="current_turn"` both assistant messages carry loss.

Records are {"messages": [...]} or {"messages": [...], "tools": [READ_FILE_TOOL]}, the schema of
c2/data/examples.py's ConversationToExample. Deterministic for a given Python version: files in
sorted path order, definitions in source order, duplicates (same definition text) dropped.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import textwrap
from typing import Iterator, Sequence

from c2.data import stdlib_corpus

# "Moderate body": big enough to be a real task, small enough that most chats fit 512-1024 tokens.
MIN_BODY_STATEMENTS = 2  # statements after the docstring
MIN_DEFINITION_LINES, MAX_DEFINITION_LINES = 5, 40
MAX_DEFINITION_CHARS = 1500
MIN_DOCSTRING_CHARS, MAX_DOCSTRING_CHARS = 20, 800
TOOL_USE_PER_MILLE = 250
CONTEXT_LINES_BEFORE, CONTEXT_LINES_AFTER = 30, 10
MAX_CONTEXT_CHARS = 1500

READ_FILE_TOOL = {"type": "function", "function": {
    "name": "read_file",
    "description": "Read lines of a file of the Python standard library (paths relative to Lib/). "
                   "With `around`, returns the lines around that definition, the definition "
                   "itself elided.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "description": "e.g. json/decoder.py"},
        "around": {"type": "string", "description": "a qualified name, e.g. JSONDecoder.decode"}},
        "required": ["path"]}}}
READ_FILE_CALL_ID = "functions.read_file:0"


def module_name(relative_path: str) -> str:
  """json/decoder.py -> json.decoder; json/__init__.py -> json."""
  parts = relative_path[:-len(".py")].split("/")
  if parts[-1] == "__init__" and len(parts) > 1:
    parts = parts[:-1]
  return ".".join(parts)


def _definitions(body: Sequence[ast.stmt], classes: tuple[str, ...] = ()
                 ) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, tuple[str, ...]]]:
  """Module-level functions and methods (also under if/try), in source order; not nested defs."""
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node, classes
    elif isinstance(node, ast.ClassDef):
      yield from _definitions(node.body, classes + (node.name,))
    elif isinstance(node, ast.If):
      yield from _definitions(node.body + node.orelse, classes)
    elif isinstance(node, ast.Try):
      yield from _definitions(
          node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody,
          classes)


def _first_line(node) -> int:
  """1-based first line of a definition, decorators included."""
  return min([node.lineno] + [d.lineno for d in node.decorator_list])


def _is_stub(statements: Sequence[ast.stmt]) -> bool:
  """`pass`, `...` or `raise NotImplementedError` bodies are not worth a task."""
  return all(isinstance(s, ast.Pass) or
             (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) or
             (isinstance(s, ast.Raise) and "NotImplementedError" in ast.unparse(s))
             for s in statements)


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  """`name(args) -> returns` as written (annotations and defaults included)."""
  text = f"{node.name}({ast.unparse(node.args)})"
  return text + (f" -> {ast.unparse(node.returns)}" if node.returns else "")


def _context(lines: list[str], first: int, last: int, placeholder: str) -> tuple[str, str]:
  """Lines around [first, last] (0-based, inclusive), the definition replaced by `placeholder`.

  Returns ("lines a-b", text): the 1-based range shown, and at most about MAX_CONTEXT_CHARS.
  """
  before = lines[max(0, first - CONTEXT_LINES_BEFORE):first]
  after = lines[last + 1:last + 1 + CONTEXT_LINES_AFTER]
  # Trim the far end of the "before" window first: the nearest lines say the most.
  while before and len("".join(before + after)) > MAX_CONTEXT_CHARS:
    before = before[1:]
  while after and len("".join(before + after)) > MAX_CONTEXT_CHARS:
    after = after[:-1]
  shown = f"lines {first + 1 - len(before)}-{last + 1 + len(after)}"
  return shown, "".join(before) + placeholder + "\n" + "".join(after)


def _uses_tool(task_id: str) -> bool:
  digest = hashlib.sha256(b"tool:" + task_id.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "little") % 1000 < TOOL_USE_PER_MILLE


def _read_file_turns(relative_path: str, qualname: str, lines: list[str], first: int,
                     last: int) -> list[dict]:
  """The assistant's read_file call and the tool's answer: the code around lines [first, last]."""
  indent = lines[first][:len(lines[first]) - len(lines[first].lstrip())]
  name = qualname.rsplit(".", 1)[-1]
  shown, context = _context(lines, first, last, f"{indent}# ... `{name}` (elided) ...")
  call = {"id": READ_FILE_CALL_ID, "type": "function", "function": {
      "name": "read_file", "arguments": json.dumps({"path": relative_path, "around": qualname})}}
  return [{"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": READ_FILE_CALL_ID, "name": "read_file",
           "content": f"{relative_path}, {shown} (`{qualname}` elided):\n{context}"}]


def file_tasks(relative_path: str, text: str) -> Iterator[dict]:
  """The chat records of one source file, in source order."""
  try:
    tree = ast.parse(text)
  except (SyntaxError, ValueError):  # a few stdlib files target other grammars or hold NULs
    return
  lines = text.splitlines(keepends=True)
  module = module_name(relative_path)
  for node, classes in _definitions(tree.body):
    docstring = ast.get_docstring(node, clean=True)
    if (not docstring or not MIN_DOCSTRING_CHARS <= len(docstring) <= MAX_DOCSTRING_CHARS
        or len(node.body) - 1 < MIN_BODY_STATEMENTS or _is_stub(node.body[1:])):
      continue
    first, last = _first_line(node) - 1, node.end_lineno - 1
    if not MIN_DEFINITION_LINES <= last - first + 1 <= MAX_DEFINITION_LINES:
      continue
    code = textwrap.dedent("".join(lines[first:last + 1])).rstrip()
    # dedent gives up when a string literal starts a line at column 0; such code is left out.
    if len(code) > MAX_DEFINITION_CHARS or not code.startswith(("def ", "async def ", "@")):
      continue
    qualname = ".".join(classes + (node.name,))
    where = f"module `{module}`" + (f", a method of class `{'.'.join(classes)}`" if classes else "")
    request = (f"Implement `{signature(node)}` in the Python standard library {where}.\n\n"
               f"Specification (its docstring):\n{docstring}\n\n"
               "Reply with the complete definition in a ```python block.")
    answer = {"role": "assistant", "content": f"```python\n{code}\n```"}
    messages = [{"role": "user", "content": request}]
    record = {"messages": messages}
    if _uses_tool(f"{relative_path}:{qualname}"):
      messages += _read_file_turns(relative_path, qualname, lines, first, last)
      record["tools"] = [READ_FILE_TOOL]
    messages.append(answer)
    yield record


@functools.lru_cache(maxsize=None)
def chat_records_json(split: str) -> tuple[str, ...]:
  """The split's records as JSON strings (immutable and compact; parsed once per process)."""
  root = stdlib_corpus.stdlib_root()
  records, seen = [], set()
  for path in stdlib_corpus.stdlib_files(split):
    for record in file_tasks(path.relative_to(root).as_posix(), stdlib_corpus.read_source(path)):
      answer = record["messages"][-1]["content"]
      if answer not in seen:  # the stdlib repeats a few definitions verbatim
        seen.add(answer)
        records.append(json.dumps(record, ensure_ascii=False))
  return tuple(records)


def chat_records(split: str) -> list[dict]:
  """The split's chat records, in corpus order."""
  return [json.loads(r) for r in chat_records_json(split)]


class StdlibChatSource:
  """Random-access source of the split's records (grain RandomAccessDataSource protocol)."""

  def __init__(self, split: str):
    self._records = chat_records_json(split)

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> dict:
    return json.loads(self._records[index])
