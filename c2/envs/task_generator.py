"""Offline, seeded generator of small Python coding tasks with oracle solutions.

The difficulty ladder (LADDER), from what a few-million-parameter model can learn on CPU upwards:
  1 set_constant        set a constant the prompt names, in the file it names
  1 rename_symbol       rename a function the prompt names, in the file it names, one caller
  2 rename_symbol       the same with several callers, and the file not named (grep for it)
  3 fix_bug             a planted bug (off-by-one, wrong operator) that the visible tests reveal
  4 implement_function  write a function from its docstring, graded by hidden tests
  5 add_parameter       add a parameter and pass it through callers in three files
  5 restore_feature     a tested function and its command were deleted; restore the behaviour
                        (Composer 2.5's "feature deletion" tasks)
Code comes from c2/envs/task_templates.py with seeded names, inputs and constants. Every counted
hidden test is built to fail on the unmodified files, so doing nothing scores exactly 0. Each
task's `solution` is the oracle's tool calls (explore, edit_file with exact search text, check,
finish); the generator replays them and checks that they produce the reference files.

Splits: a task's family (kind, template and chosen names) is hashed into train or heldout, so the
two splits never share a task, nor even a function/name combination.

  python -m c2.envs.task_generator --seed 0 --count 20 --split train --out tasks.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import random
import sys
from typing import Optional, Sequence

from c2.envs import task_templates as tt
from c2.envs import tasks as tasklib

TEST_COMMAND = "python -m unittest -v -b tests.test_hidden"
VISIBLE_TEST_COMMAND = "python -m unittest -v"
LADDER = ((1, "set_constant"), (1, "rename_symbol"), (2, "rename_symbol"), (3, "fix_bug"),
          (4, "implement_function"), (5, "add_parameter"), (5, "restore_feature"))
HELDOUT_FRACTION = 0.25  # of families
_MAX_ATTEMPTS = 1000  # draws per task; heldout accepts about 1 in 4


def _edit_calls(path: str, before: str, after: str) -> list[dict]:
  """edit_file calls turning before into after; each search text widened until it is unique.

  Blocks are edited bottom-up, so the lines above a block are still the original ones when its
  search text is chosen and checked against the file as it is at that point. Unique means no
  second match, overlapping ones included, so any reading of "occurs once" agrees.
  """
  if not before:
    return [_tool("write_file", path=path, content=after)]
  old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
  current, calls = list(old), []
  for tag, i1, i2, j1, j2 in reversed(
      difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()):
    if tag == "equal":
      continue
    lo, hi = i1, i2
    while not (search := "".join(current[lo:hi])) or (
        (text := "".join(current)).find(search) != text.rfind(search)):
      lo, hi = (lo - 1, hi) if lo > 0 else (lo, hi + 1)
    replace = "".join(current[lo:i1] + new[j1:j2] + current[i2:hi])
    current[lo:hi] = replace.splitlines(keepends=True)
    calls.append(_tool("edit_file", path=path, search=search, replace=replace))
  return calls


def _tool(name: str, **arguments: str) -> dict:
  return {"name": name, "arguments": arguments}


@dataclasses.dataclass
class _Draft:
  """A task before its split is known: start and target files, and how the oracle explores."""

  kind: str
  family: tuple[str, ...]  # what the split hashes: kind, template and the names chosen
  prompt: str
  files: dict[str, str]
  solved: dict[str, str]  # the reference files after the change
  hidden_test: tuple[str, list[str]]  # (tests/test_hidden.py text, counted test names)
  explore: list[dict]  # oracle calls before editing
  check: list[dict] = dataclasses.field(default_factory=list)  # oracle calls after editing
  visible_test_command: Optional[str] = None


def _package(pkg: str, modules: dict[str, str]) -> dict[str, str]:
  files = {f"{pkg}/__init__.py": f'"""The {pkg} package."""\n', "tests/__init__.py": ""}
  files.update({f"{pkg}/{name}.py": text for name, text in modules.items()})
  return files


def _set_constant(rng: random.Random, level: int) -> _Draft:
  pkg = rng.choice(tt.PACKAGES)
  chosen = rng.sample(tt.CONSTANTS, rng.randint(4, 6))
  values = {name: make(rng) for name, make in chosen}
  target, make = rng.choice(chosen)
  new = make(rng)
  while new == values[target]:
    new = make(rng)

  def settings(vals):
    lines = "".join(f"{name} = {value!r}\n" for name, value in vals.items())
    table = "".join(f'        "{name}": {name},\n' for name in vals)
    as_dict = f'def as_dict():\n    """Every setting by name."""\n    return {{\n{table}    }}\n'
    return _package(pkg, {"settings": tt.module_source(f"Settings of the {pkg} package.",
                                                       [lines, as_dict])})

  others = {k: v for k, v in values.items() if k != target}
  # Each test checks the new value first, so all of them fail on the unmodified file.
  hidden = tt.unittest_module("Hidden tests of the settings change.",
                              [f"from {pkg} import settings"], "TestSettings", [
      ("test_value", tt.assertion(f"settings.{target}", new)),
      ("test_as_dict_reports_it", tt.assertion(f'settings.as_dict()["{target}"]', new)),
      ("test_others_unchanged", tt.assertion(f"settings.{target}", new) + "\n" + tt.assertion(
          f"{{k: v for k, v in settings.as_dict().items() if k != {target!r}}}", others))])
  path = f"{pkg}/settings.py"
  # Every span the policy copies is quoted as it appears in the code and the tool-call JSON: a
  # BPE tokenizer gives " orbit" and "orbit" different tokens, so an unquoted name in prose is a
  # different token sequence from the same name in a path argument (tiny models fail that copy).
  line = f"{target} = {new!r}"
  prompt = rng.choice(("Set `{l}` in `{p}`.", "In `{p}`, change the setting `{t}` to `{l}`.",
                       "`{p}` should say `{l}`. Please make that change."))
  return _Draft("set_constant", ("set_constant", target, pkg),
                prompt.format(t=target, p=path, l=line), settings(values),
                settings({**values, target: new}), hidden, [_tool("read_file", path=path)])


def _rename_symbol(rng: random.Random, level: int) -> _Draft:
  pkg, module = rng.choice(tt.PACKAGES), rng.choice(tt.MODULES)
  template, other, distractor = rng.sample(tt.TEMPLATES, 3)
  old, new = rng.sample(template.names, 2)
  other_src = other.source(rng.choice(other.names))
  callers = rng.sample(tt.CALLERS, 1 if level <= 1 else rng.randint(2, 3))

  def source(name):
    return tt.module_source(f"Helpers of the {pkg} package.", [
        template.source(name), other_src] + [src.format(old=name) for _, src in callers])

  after, cases = source(new), tt.distinct_inputs(template, rng)[:3]
  gone = f"self.assertFalse(hasattr({module}, {old!r}))"  # fails until the rename
  tests = [("test_new_name", tt.assertion(tt.call_text(module, new, cases[0]),
                                          tt.run_function(after, new, cases[0]))),
           ("test_old_name_removed", gone)]
  tests += [(f"test_{caller}_uses_new_name", gone + "\n" + tt.assertion(
      tt.call_text(module, caller, [cases]), tt.run_function(after, caller, [cases])))
            for caller, _ in callers]
  hidden = tt.unittest_module("Hidden tests of the rename.", [f"from {pkg} import {module}"],
                              "TestRename", tests)
  path, extra = f"{pkg}/{module}.py", {}
  if level <= 1:
    # The names unquoted: in the code they mostly follow a space (`def name`, `= name(`), so the
    # prompt's tokens for them are the ones the edits write.
    prompt = (f"Rename the function {old} in `{path}` to {new} and update its caller in that "
              "file.")
    explore = [_tool("read_file", path=path)]
  else:  # a second module, so the policy has to search for the function
    extra[rng.choice([m for m in tt.MODULES if m != module])] = tt.module_source(
        f"More helpers of the {pkg} package.", [distractor.source(rng.choice(distractor.names))])
    prompt = (f"Rename the function `{old}` of the `{pkg}` package to `{new}`, and update every "
              "place that calls it.")
    explore = [_tool("grep", pattern=old, path=pkg), _tool("read_file", path=path)]
  return _Draft("rename_symbol", ("rename_symbol", template.key, old, new), prompt,
                _package(pkg, {module: source(old), **extra}),
                _package(pkg, {module: after, **extra}), hidden, explore)


def _fix_bug(rng: random.Random, level: int) -> Optional[_Draft]:
  pkg, module = rng.choice(tt.PACKAGES), rng.choice(tt.MODULES)
  template, other = rng.sample(tt.TEMPLATES, 2)
  fn, other_fn = rng.choice(template.names), rng.choice(other.names)
  bug = rng.randrange(len(template.bugs))
  good, other_src = template.source(fn), other.source(other_fn)
  bad = template.source(fn, template.body.replace(*template.bugs[bug], 1))
  cases = tt.distinct_inputs(template, rng)
  failing = [args for args in cases
             if tt.run_function(bad, fn, args) != tt.run_function(good, fn, args)]
  if len(failing) < 3:
    return None  # this draw of inputs hardly exercises the bug; draw again
  passing = [args for args in cases if args not in failing]
  visible, _ = tt.unittest_module(
      f"Tests of {pkg}.{module}.", [f"from {pkg} import {module}"], "TestModule",
      tt.call_tests(module, fn, good, passing[:1] + failing[:1])
      + tt.call_tests(module, other_fn, other_src, tt.distinct_inputs(other, rng)[:2]),
      f"tests.test_{module}")
  # Counted: only inputs on which the bug shows, so the unfixed code scores 0.
  hidden = tt.unittest_module("Hidden tests of the bug fix.", [f"from {pkg} import {module}"],
                              "TestFix", tt.call_tests(module, fn, good, failing[:5]))

  def files(src):
    code = tt.module_source(f"Helpers of the {pkg} package.", [src, other_src])
    return {**_package(pkg, {module: code}), f"tests/test_{module}.py": visible}

  prompt = (f"The tests of the `{pkg}` package fail. Run `{VISIBLE_TEST_COMMAND}` to see which, "
            "then fix the bug in the package's code. Do not change the tests.")
  run = _tool("run", command=VISIBLE_TEST_COMMAND)
  return _Draft("fix_bug", ("fix_bug", template.key, str(bug), fn), prompt, files(bad),
                files(good), hidden, [run, _tool("read_file", path=f"{pkg}/{module}.py")],
                [run], VISIBLE_TEST_COMMAND)


def _implement_function(rng: random.Random, level: int) -> Optional[_Draft]:
  pkg, module = rng.choice(tt.PACKAGES), rng.choice(tt.MODULES)
  template, other = rng.sample(tt.TEMPLATES, 2)
  fn, other_src = rng.choice(template.names), other.source(rng.choice(other.names))
  good, cases = template.source(fn), tt.distinct_inputs(template, rng)
  if len(cases) < 5:
    return None
  examples = [line for args in cases[:2] for line in (
      f">>> {fn}({', '.join(map(repr, args))})", repr(tt.run_function(good, fn, args)))]
  hidden = tt.unittest_module("Hidden tests of the implementation.",
                              [f"from {pkg} import {module}"], "TestImplementation",
                              tt.call_tests(module, fn, good, cases[2:8]))

  def files(body):
    code = template.source(fn, body, examples)
    return _package(pkg, {module: tt.module_source(f"Helpers of the {pkg} package.",
                                                   [other_src, code])})

  path = f"{pkg}/{module}.py"
  prompt = rng.choice(("Implement `{f}` in `{p}` as its docstring describes.",
                       "`{f}` in `{p}` is only a stub. Write it so it does what its docstring "
                       "says."))
  return _Draft("implement_function", ("implement_function", template.key, fn),
                prompt.format(f=fn, p=path), files("    raise NotImplementedError\n"),
                files(template.body), hidden, [_tool("read_file", path=path)])


def _add_parameter(rng: random.Random, level: int) -> _Draft:
  pkg, key = rng.choice(tt.PACKAGES), rng.choice(sorted(tt.PARAMETER_PROJECTS))
  project = tt.PARAMETER_PROJECTS[key]
  param, default = rng.choice(project["params"]), project["default"]
  src, dst, factor = rng.choice(tt.CONVERSIONS)
  units = dict(src=src, dst=dst)
  names = {m: rng.choice(spec[0]).format(**units) for m, spec in project["modules"].items()}
  base, *users = names
  if key == "round":
    values = [round(rng.uniform(0, 100), 1) for _ in range(rng.randint(2, 4))]
    args, constants = {"units": [values[0]], "report": [values], "totals": [values]}, [
        f"FACTOR = {factor!r}\n"]
  else:
    words = [rng.sample(tt.WORDS, rng.randint(2, 3)) for _ in range(2)]
    args, constants = {"text": [words[0]], "labels": [words[0]], "menu": [words]}, []

  def functions(new: bool) -> dict[str, str]:
    fill = dict(units, f=names[base], p=param if new else repr(default),
                v=param if new else repr(default), a=f", {param}" if new else "")
    extra = f", {param}={default!r}" if new else ""
    return {m: tt.function_source(names[m], params + extra, doc.format(**fill),
                                  body.format(**fill))
            for m, (_, params, doc, body) in project["modules"].items()}

  def modules(new: bool) -> dict[str, str]:
    imports = [f"from {pkg}.{base} import {names[base]}"]
    return _package(pkg, {m: tt.module_source(
        f"The {m} of the {pkg} package.", (constants + [code]) if m == base else [code],
        [] if m == base else imports) for m, code in functions(new).items()})

  # All three functions in one namespace, to run the reference without importing the package.
  after = "".join(constants) + "\n".join(functions(True).values())
  checks = list(zip(names, project["passed"])) + [(base, default)]
  tests = [(f"test_{names[m]}_{param}_{n}", tt.assertion(
      tt.call_text(m, names[m], args[m], {param: value}),
      tt.run_function(after, names[m], args[m], {param: value})))
           for n, (m, value) in enumerate(checks)]  # every call passes the new keyword
  hidden = tt.unittest_module("Hidden tests of the new parameter.",
                              [f"from {pkg} import {', '.join(sorted(names))}"], "TestParameter",
                              tests)
  paths = [f"{pkg}/{m}.py" for m in names]
  prompt = (f"Add a `{param}` parameter (default `{default!r}`) to `{names[base]}` in `{paths[0]}`"
            f" that replaces the fixed {default!r} it uses now. Give `{names[users[0]]}` "
            f"(`{paths[1]}`) and `{names[users[1]]}` (`{paths[2]}`) the same parameter with the "
            f"same default, and pass it through to `{names[base]}`.")
  return _Draft("add_parameter", ("add_parameter", key, names[base], param), prompt,
                modules(False), modules(True), hidden,
                [_tool("grep", pattern=names[base], path=pkg)]
                + [_tool("read_file", path=p) for p in paths])


def _restore_feature(rng: random.Random, level: int) -> _Draft:
  pkg, module = rng.choice(tt.PACKAGES), rng.choice(tt.MODULES)
  chosen = rng.sample(tt.TEMPLATES, 3)
  fns = [rng.choice(t.names) for t in chosen]
  sources = [t.source(fn) for fn, t in zip(fns, chosen)]
  cases = [tt.distinct_inputs(t, rng) for t in chosen]
  gone, command = rng.randrange(3), [fn.replace("_", "-") for fn in fns]
  kept = [i for i in range(3) if i != gone]

  def project(present: list[int]) -> dict[str, str]:
    table = "".join(f'    "{command[i]}": {module}.{fns[i]},\n' for i in present)
    commands = tt.module_source(f"Command table of the {pkg} tool.", [
        f"COMMANDS = {{\n{table}}}\n",
        'def dispatch(command, *args):\n    """Run the named command on args."""\n'
        "    return COMMANDS[command](*args)\n",
        'def available():\n    """The command names, sorted."""\n    return sorted(COMMANDS)\n'],
        [f"from {pkg} import {module}"])
    code = tt.module_source(f"Helpers of the {pkg} package.", [sources[i] for i in present])
    return _package(pkg, {module: code, "commands": commands})

  def dispatch_test(i, name):
    args = cases[i][1]
    return (name, tt.assertion(tt.call_text("commands", "dispatch", [command[i], *args]),
                               tt.run_function(sources[i], fns[i], args)))

  imports = [f"from {pkg} import commands, {module}"]
  visible, _ = tt.unittest_module(
      f"Tests of the {pkg} package.", imports, "TestPackage",
      [t for i in kept for t in tt.call_tests(module, fns[i], sources[i], cases[i][:1])
       + [dispatch_test(i, f"test_dispatch_{fns[i]}")]], f"tests.test_{module}")
  # The deleted feature's tests went with it: they come back as the hidden tests.
  hidden = tt.unittest_module("Hidden tests of the restored feature.", imports, "TestRestored", [
      *tt.call_tests(module, fns[gone], sources[gone], cases[gone][2:5]),
      dispatch_test(gone, "test_dispatch"),
      ("test_listed", f"self.assertIn({command[gone]!r}, commands.available())")])
  example = cases[gone][0]
  prompt = (f"The `{command[gone]}` command of `{pkg}` is gone: its function "
            f"`{module}.{fns[gone]}({chosen[gone].params})` and its entry in "
            f"`{pkg}/commands.py` were deleted. Restore both. {chosen[gone].doc} For example, "
            f"`{fns[gone]}({', '.join(map(repr, example))})` returns "
            f"`{tt.run_function(sources[gone], fns[gone], example)!r}`.")
  tests_file = {f"tests/test_{module}.py": visible}
  run = _tool("run", command=VISIBLE_TEST_COMMAND)
  return _Draft("restore_feature", ("restore_feature", chosen[gone].key, fns[gone]), prompt,
                {**project(kept), **tests_file}, {**project([0, 1, 2]), **tests_file}, hidden,
                [_tool("read_file", path=f"{pkg}/{module}.py"),
                 _tool("read_file", path=f"{pkg}/commands.py")], [run], VISIBLE_TEST_COMMAND)


KINDS = {"set_constant": _set_constant, "rename_symbol": _rename_symbol, "fix_bug": _fix_bug,
         "implement_function": _implement_function, "add_parameter": _add_parameter,
         "restore_feature": _restore_feature}


def _digest(family: Sequence[str]) -> str:
  return hashlib.sha256("\x1f".join(family).encode()).hexdigest()


def split_of(family: Sequence[str]) -> str:
  """The split a task family belongs to: a stable hash, the same in every process."""
  return "heldout" if int(_digest(family)[:16], 16) < HELDOUT_FRACTION * 2**64 else "train"


def _to_task(draft: _Draft, level: int, split: str) -> tasklib.Task:
  """Adds the oracle's edits and finish, checks they reproduce the reference files."""
  changed = [p for p in draft.solved if draft.files.get(p) != draft.solved[p]]
  edits = [c for p in changed for c in _edit_calls(p, draft.files.get(p, ""), draft.solved[p])]
  solution = draft.explore + edits + draft.check + [
      _tool("finish", message=f"Done: changed {', '.join(changed)}.")]
  if tasklib.apply_tool_calls(draft.files, solution) != draft.solved:
    raise AssertionError(f"{draft.kind}: the oracle's edits do not give the reference files")
  hidden_text, names = draft.hidden_test
  if not names:
    raise AssertionError(f"{draft.kind}: a task needs counted hidden tests")
  content = json.dumps([draft.prompt, draft.files, hidden_text], sort_keys=True)
  return tasklib.Task(
      task_id=f"{draft.kind}-l{level}-{split}-{_digest([content])[:12]}",
      prompt=draft.prompt, files=draft.files, test_command=TEST_COMMAND,
      hidden_files={"tests/test_hidden.py": hidden_text},
      visible_test_command=draft.visible_test_command,
      tags=(f"level:{level}", f"kind:{draft.kind}", f"family:{_digest(draft.family)[:16]}",
            "source:generated"), level=level,
      split=split, solution=tuple(solution), test_names=tuple(names))


def generate(seed: int, count: int, *, split: str = "train",
             levels: Sequence[int] = (1, 2, 3, 4, 5)) -> list[tasklib.Task]:
  """`count` distinct tasks of `split`, cycling through the LADDER entries of `levels`.

  Deterministic for (seed, split, levels), and a prefix of any longer list from the same
  arguments.
  """
  if split not in tasklib.SPLITS:
    raise ValueError(f"split must be one of {tasklib.SPLITS}, got {split!r}")
  ladder = [(level, kind) for level, kind in LADDER if level in levels]
  if not ladder or not set(levels) <= {level for level, _ in LADDER}:
    raise ValueError(f"levels must be a non-empty subset of 1..5, got {tuple(levels)}")
  rng = random.Random(int.from_bytes(hashlib.sha256(f"{seed}:{split}".encode()).digest()[:8],
                                     "big"))
  tasks, seen = [], set()
  for index in range(count):
    level, kind = ladder[index % len(ladder)]
    for _ in range(_MAX_ATTEMPTS):
      draft = KINDS[kind](rng, level)
      if draft is None or split_of(draft.family) != split:
        continue
      task = _to_task(draft, level, split)
      if task.task_id not in seen:
        break
    else:
      raise RuntimeError(f"no new {split} task of kind {kind} after {_MAX_ATTEMPTS} draws")
    seen.add(task.task_id)
    tasks.append(task)
  return tasks


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--count", type=int, default=20)
  parser.add_argument("--split", choices=tasklib.SPLITS, default="train")
  parser.add_argument("--levels", default="1,2,3,4,5", help="comma-separated, e.g. 1,2")
  parser.add_argument("--out", required=True, help="JSONL file to write")
  args = parser.parse_args(argv)
  levels = tuple(int(level) for level in args.levels.split(","))
  tasks = generate(args.seed, args.count, split=args.split, levels=levels)
  tasklib.write_jsonl(tasks, args.out)
  kinds = sorted({(t.level, t.kind) for t in tasks})
  print(f"wrote {len(tasks)} {args.split} tasks to {args.out}: "
        + ", ".join(f"L{lvl} {kind} x{sum(t.kind == kind and t.level == lvl for t in tasks)}"
                    for lvl, kind in kinds), file=sys.stderr)


if __name__ == "__main__":
  main()
