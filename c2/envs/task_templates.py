"""The code library the task generator builds from: function templates, name pools, and text.

Each FunctionTemplate is a small, real, self-contained Python function: interchangeable names,
a docstring precise enough to implement it from, a body, planted bugs (a correct snippet of the
body and its off-by-one or wrong-operator replacement) and a seeded input generator. Expected
values in generated tests are computed by running these functions (`run_function`), never typed
by hand, so a test and the code it checks cannot disagree.

Generated code is PEP 8 (4-space indentation), as in the repositories a policy will meet; this
package's own 2-space style does not apply to it.
"""
from __future__ import annotations

import dataclasses
import json
import random
import textwrap
from typing import Any, Callable, Mapping, Sequence

WORDS = ("apple", "level", "river", "stone", "noon", "cloud", "tiger", "radar", "maple",
         "queue", "ocean", "civic", "lemon", "kayak", "mouse", "unity", "bridge", "refer",
         "candle", "puzzle")
PHRASES = ("Racecar", "Never odd or even", "A man, a plan, a canal: Panama", "stone", "Noon",
           "No lemon, no melon", "Step on no pets", "hello", "Was it a car or a cat I saw?",
           "Top spot", "Eva, can I see bees in a cave?", "kayak 2", "12 21", "Radar!")
PACKAGES = ("inventory", "ledger", "weather", "garden", "orbit", "recipes", "library", "transit",
            "payroll", "arcade")
MODULES = ("core", "calc", "text_tools", "numbers", "stats", "logic", "routines", "basics")
CALLERS = (  # (name, source) of functions that call {old}(*args) for each argument tuple
    ("process_batch", 'def process_batch(calls):\n    """{old} applied to each argument tuple in '
     'calls."""\n    return [{old}(*args) for args in calls]\n'),
    ("first_result", 'def first_result(calls):\n    """{old} of the first argument tuple in calls,'
     ' or None."""\n    for args in calls:\n        return {old}(*args)\n    return None\n'),
    ("results_by_index", 'def results_by_index(calls):\n    """Position -> {old} of the argument '
     'tuple there."""\n    results = {{}}\n    for index, args in enumerate(calls):\n'
     '        results[index] = {old}(*args)\n    return results\n'),
)
# (name, value maker) of the settings in set_constant tasks.
CONSTANTS = (
    ("MAX_RETRIES", lambda rng: rng.randint(1, 9)),
    ("TIMEOUT_SECONDS", lambda rng: rng.choice((5, 10, 15, 30, 60, 120))),
    ("PAGE_SIZE", lambda rng: rng.choice((10, 20, 25, 50, 100))),
    ("CACHE_TTL", lambda rng: rng.randint(1, 60) * 60),
    ("BATCH_SIZE", lambda rng: 2 ** rng.randint(3, 9)),
    ("DEFAULT_PORT", lambda rng: rng.randint(1024, 9999)),
    ("LOG_LEVEL", lambda rng: rng.choice(("DEBUG", "INFO", "WARNING", "ERROR"))),
    ("API_VERSION", lambda rng: f"v{rng.randint(1, 6)}"),
    ("DISCOUNT_RATE", lambda rng: rng.randint(1, 40) / 100),
    ("ENABLE_CACHE", lambda rng: rng.random() < 0.5),
    ("MAX_USERS", lambda rng: rng.randint(2, 500)),
    ("CURRENCY", lambda rng: rng.choice(("EUR", "USD", "GBP", "JPY", "CHF"))),
    ("GREETING", lambda rng: rng.choice(("Hello", "Welcome", "Hi there", "Good day"))),
    ("BACKOFF_FACTOR", lambda rng: rng.choice((1.5, 2.0, 2.5, 3.0))),
)
# (from unit, to unit, factor) of the "round" projects of add_parameter tasks.
CONVERSIONS = (("miles", "kilometres", 1.609344), ("pounds", "kilograms", 0.45359237),
               ("inches", "centimetres", 2.54), ("gallons", "litres", 3.785411784),
               ("feet", "metres", 0.3048), ("ounces", "grams", 28.349523125))
# Three-module projects of add_parameter tasks. The first module's function uses a fixed value
# that becomes a parameter; the other two call it and pass the parameter through. Per module:
# (name choices, params, doc, body) with {v} the value (a literal, then the parameter), {p} its
# name in docstrings, {f} the first function's name, {a} the pass-through argument.
PARAMETER_PROJECTS = {
    "round": dict(
        params=("digits", "places", "ndigits", "precision"), default=2, passed=(3, 1, 0),
        modules={
            "units": (("{src}_to_{dst}",), "value",
                      "Convert value from {src} to {dst}, rounded to {p} decimal places.",
                      "    return round(value * FACTOR, {v})\n"),
            "report": (("convert_all", "as_{dst}"), "values", "Every value converted to {dst}.",
                       "    return [{f}(value{a}) for value in values]\n"),
            "totals": (("converted_total", "total_{dst}"), "values",
                       "The sum of the converted values, rounded like each of them.",
                       "    return round(sum({f}(value{a}) for value in values), {v})\n")}),
    "join": dict(
        params=("sep", "separator", "delimiter"), default=", ", passed=(" | ", "; ", " and "),
        modules={
            "text": (("join_words", "comma_join"), "words", "Join words with {p} between them.",
                     "    return {v}.join(words)\n"),
            "labels": (("bracketed", "as_label"), "words", "The words joined, in square brackets.",
                       '    return "[" + {f}(words{a}) + "]"\n'),
            "menu": (("menu_text", "render_menu"), "sections",
                     "One line per section: its words joined.",
                     '    return "\\n".join({f}(words{a}) for words in sections)\n')}),
}


@dataclasses.dataclass(frozen=True)
class FunctionTemplate:
  key: str
  names: tuple[str, ...]  # interchangeable names for the function
  params: str
  doc: str  # precise enough to implement the function from
  body: str  # 4-space indented, as it appears in the generated file
  bugs: tuple[tuple[str, str], ...]  # (correct snippet of body, planted buggy replacement)
  inputs: Callable[[random.Random], list[tuple]]

  def source(self, name: str, body: str | None = None, examples: Sequence[str] = ()) -> str:
    """The function's code under `name` (with another body, e.g. a stub or a planted bug)."""
    return function_source(name, self.params, self.doc, self.body if body is None else body,
                           examples)


def _ints(rng: random.Random, low: int, high: int, size: tuple[int, int] = (0, 7)) -> list[int]:
  return [rng.randint(low, high) for _ in range(rng.randint(*size))]


TEMPLATES = (
    FunctionTemplate(
        "clamp", ("clamp", "clip_value", "bound_value"), "value, low, high",
        "Return value limited to low..high: low if value is below low, high if it is above "
        "high, otherwise value.",
        "    if value < low:\n        return low\n    if value > high:\n        return high\n"
        "    return value\n",
        (("return high\n", "return high - 1\n"), ("if value < low:", "if value > low:")),
        lambda rng: [(rng.randint(-30, 30), -10, 10) for _ in range(8)] + [(25, -10, 10)]),
    FunctionTemplate(
        "count_vowels", ("count_vowels", "vowel_count", "num_vowels"), "text",
        "Return how many characters of text are vowels (a, e, i, o, u), ignoring case.",
        '    return sum(1 for ch in text.lower() if ch in "aeiou")\n',
        (('"aeiou"', '"aeio"'), ("text.lower()", "text")),
        lambda rng: [(" ".join(rng.sample(WORDS, 2)).title(),) for _ in range(8)] + [("QUEUE",)]),
    FunctionTemplate(
        "running_total", ("running_total", "cumulative_sum", "prefix_sums"), "values",
        "Return the list of running totals of values: item i is values[0] + ... + values[i].",
        "    totals = []\n    total = 0\n    for value in values:\n        total += value\n"
        "        totals.append(total)\n    return totals\n",
        (("total += value", "total = value"), ("totals.append(total)", "totals.append(value)")),
        lambda rng: [(_ints(rng, -5, 9),) for _ in range(8)] + [([1, 2, 3],)]),
    FunctionTemplate(
        "triangular", ("triangular", "sum_to", "triangle_number"), "n",
        "Return 1 + 2 + ... + n, the sum of the integers from 1 to n (0 when n < 1).",
        "    return sum(range(1, n + 1))\n",
        (("range(1, n + 1)", "range(1, n)"), ("range(1, n + 1)", "range(2, n + 1)")),
        lambda rng: [(rng.randint(-2, 40),) for _ in range(8)] + [(1,), (0,)]),
    FunctionTemplate(
        "chunk", ("chunk", "batched", "split_every"), "items, size",
        "Split the list items into consecutive lists of size items each; the last may be shorter.",
        "    return [items[i:i + size] for i in range(0, len(items), size)]\n",
        (("items[i:i + size]", "items[i:i + size - 1]"),
         ("range(0, len(items), size)", "range(0, len(items) - 1, size)")),
        lambda rng: [(list(range(rng.randint(0, 9))), rng.randint(1, 4)) for _ in range(8)]),
    FunctionTemplate(
        "is_palindrome", ("is_palindrome", "reads_same_backwards", "palindromic"), "text",
        "Return True if text reads the same forwards and backwards, looking only at its letters "
        "and digits and ignoring case.",
        "    cleaned = [ch.lower() for ch in text if ch.isalnum()]\n"
        "    return cleaned == cleaned[::-1]\n",
        (("ch.lower() for", "ch for"), ("if ch.isalnum()", "if ch")),
        lambda rng: [(p,) for p in rng.sample(PHRASES, 10)]),
    FunctionTemplate(
        "dedupe", ("dedupe", "unique_in_order", "drop_duplicates"), "items",
        "Return the items of the list without repeats, keeping the first occurrence of each, in "
        "their original order.",
        "    seen = set()\n    result = []\n    for item in items:\n        if item not in seen:\n"
        "            seen.add(item)\n            result.append(item)\n    return result\n",
        (("            seen.add(item)\n", ""), ("result.append(item)", "result.insert(0, item)")),
        lambda rng: [(_ints(rng, 0, 4, (2, 8)),) for _ in range(8)]),
    FunctionTemplate(
        "longest_word", ("longest_word", "first_longest_word", "widest_word"), "text",
        "Return the longest whitespace-separated word of text, the first one if several are "
        "equally long, or '' if text has no words.",
        '    best = ""\n    for word in text.split():\n        if len(word) > len(best):\n'
        "            best = word\n    return best\n",
        (("len(word) > len(best)", "len(word) >= len(best)"),),
        lambda rng: [(" ".join(rng.sample(WORDS, rng.randint(0, 4))),) for _ in range(12)]),
    FunctionTemplate(
        "count_above", ("count_above", "count_greater", "num_above"), "values, threshold",
        "Return how many numbers in values are strictly greater than threshold.",
        "    return sum(1 for value in values if value > threshold)\n",
        (("value > threshold", "value >= threshold"), ("value > threshold", "value < threshold")),
        lambda rng: [(_ints(rng, 0, 9), rng.randint(0, 9)) for _ in range(10)]),
    FunctionTemplate(
        "digit_sum", ("digit_sum", "sum_of_digits", "add_digits"), "n",
        "Return the sum of the decimal digits of the integer n, ignoring its sign.",
        "    return sum(int(digit) for digit in str(abs(n)))\n",
        (("str(abs(n))", "str(abs(n))[1:]"), ("str(abs(n))", "str(abs(n))[:-1]")),
        lambda rng: [(rng.randint(-9999, 99999),) for _ in range(10)]),
    FunctionTemplate(
        "mean", ("mean", "average", "arithmetic_mean"), "values",
        "Return the arithmetic mean of the list of numbers values, or 0.0 when it is empty.",
        "    if not values:\n        return 0.0\n    return sum(values) / len(values)\n",
        (("sum(values) / len(values)", "sum(values) / (len(values) + 1)"),
         ("sum(values) / len(values)", "sum(values) // len(values)")),
        lambda rng: [(_ints(rng, -10, 20),) for _ in range(10)]),
    FunctionTemplate(
        "max_gap", ("max_gap", "largest_step", "biggest_jump"), "values",
        "Return the largest values[i + 1] - values[i] over neighbouring items (it may be "
        "negative), or 0 when values has fewer than two items.",
        "    return max((b - a for a, b in zip(values, values[1:])), default=0)\n",
        (("values[1:]", "values[2:]"), ("b - a", "a - b")),
        lambda rng: [(_ints(rng, 0, 30),) for _ in range(10)]),
)


def function_source(name: str, params: str, doc: str, body: str,
                    examples: Sequence[str] = ()) -> str:
  """`def name(params):`, the docstring wrapped to PEP 8 width (then doctest lines), the body."""
  lines = textwrap.wrap(doc, 80) + ([""] + list(examples) if examples else [])
  docstring = (f'    """{lines[0]}"""\n' if len(lines) == 1 else
               '    """' + "\n".join(("    " + line).rstrip() for line in lines).lstrip()
               + '\n    """\n')
  return f"def {name}({params}):\n{docstring}{body}"


def module_source(doc: str, parts: Sequence[str], imports: Sequence[str] = ()) -> str:
  """A module: docstring, imports, then parts (constants, functions) two blank lines apart."""
  head = f'"""{doc}"""\n' + "".join(f"{line}\n" for line in ("", *imports) if imports)
  return head + "\n\n" + "\n\n".join(parts)


def run_function(source: str, name: str, args: Sequence[Any],
                 kwargs: Mapping[str, Any] | None = None) -> Any:
  """Calls `name` from a self-contained source (our own templates); exceptions become a marker."""
  namespace: dict[str, Any] = {}
  exec(source, namespace)  # noqa: S102 - generator-owned template code only
  try:  # fresh copies of list arguments, so a mutating function cannot change later cases
    return namespace[name](*json.loads(json.dumps(args)), **(kwargs or {}))
  except Exception as e:  # noqa: BLE001 - a planted bug may raise; that also "differs"
    return ("raised", type(e).__name__)


def assertion(call: str, expected: Any) -> str:
  """A unittest assertion that `call` (source text) returns `expected`."""
  method = "assertAlmostEqual" if isinstance(expected, float) else "assertEqual"
  return f"self.{method}({call}, {expected!r})"


def call_text(module: str, fn: str, args: Sequence[Any],
              kwargs: Mapping[str, Any] | None = None) -> str:
  """Source text of the call module.fn(*args, **kwargs)."""
  texts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in (kwargs or {}).items()]
  return f"{module}.{fn}({', '.join(texts)})"


def call_tests(module: str, fn: str, source: str, cases: Sequence[Sequence[Any]],
               ) -> list[tuple[str, str]]:
  """One test per argument tuple: module.fn(*args) returns what `source`'s fn returns."""
  return [(f"test_{fn}_{n}", assertion(call_text(module, fn, args),
                                       run_function(source, fn, args)))
          for n, args in enumerate(cases)]


def unittest_module(doc: str, imports: Sequence[str], cls: str, tests: Sequence[tuple[str, str]],
                    dotted_name: str = "tests.test_hidden") -> tuple[str, list[str]]:
  """(module text, unittest names) of one TestCase with tests [(method, body lines)]."""
  methods = [f"    def {name}(self):\n" + textwrap.indent(body, " " * 8) + "\n"
             for name, body in tests]
  text = (f'"""{doc}"""\nimport unittest\n\n' + "\n".join(imports) + f"\n\n\nclass {cls}"
          "(unittest.TestCase):\n\n" + "\n".join(methods))
  return text, [f"{dotted_name}.{cls}.{name}" for name, _ in tests]


def distinct_inputs(template: FunctionTemplate, rng: random.Random) -> list[tuple]:
  """The template's seeded argument tuples, repeats dropped."""
  unique = {repr(args): args for args in template.inputs(rng)}  # dict: keeps first-seen order
  return list(unique.values())
