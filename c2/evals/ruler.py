"""RULER-style synthetic long-context tasks, generated locally (Hsieh et al., "RULER: What's the
Real Context Size of Your Long-Context Language Models?", arXiv 2404.06654).

Plain needle-in-a-haystack saturates early; RULER adds several keys and multi-hop tracing. The
four tasks here, in the code register the models train on (the haystack is held-out stdlib code,
so nothing but the inserted facts can give the answer away):

  niah_single        one needle `PASSKEY = 48213` at a seeded depth; the prompt ends with the
                     needle's own prefix, `PASSKEY =`, the answer is ` 48213`.
  niah_multikey      `keys` needles `KEY_QXJ = 48213`, distinct keys and values; one is asked
                     the same way (`KEY_QXJ =`).
  variable_tracking  `chains` chains of `hops` + 1 assignments, VAR_A = 48213, VAR_B = VAR_A, ...
                     (chains interleaved, every chain in assignment order); the prompt ends
                     `# variables equal to 48213:` and the answer lists the asked chain's
                     variables in assignment order, ` VAR_A, VAR_B, ...`.
  niah_code          one held-out code line as the needle, 10% of the way into the haystack
                     (so ~90% of the prompt from the query); the prompt ends with the line's
                     first third (up to a space), the answer is the rest of the line. Fair for a
                     tiny code model, which cannot read digit passkeys: code repeats its own
                     lines and identifiers, so copying a line seen earlier (induction) is what
                     such a model learns first. The needle lines occur once in the held-out
                     corpus and never in the haystack, so only the needle gives the answer.
As in RULER, the query repeats the text that precedes the answer in the context, and answers
start with the space that precedes them there: a prompt ending in a space would ask for a
tokenization of the value the model never saw (` 48213` is not ` ` + `48213`).

Scores per task and length L (scalars <task>/<metric>_len<L>, and their mean over tasks as
<metric>_len<L>):
  accuracy          exact match of the greedy continuation (what follows the answer must not
                    extend it: `48213)` matches, `482130` and `VAR_A, VAR_B, VAR_C` for a two-name
                    answer do not)
  answer_nats       teacher-forced -log p(answer | prompt)
  retrieval_nats    answer_nats of a control prompt, whose asked value is replaced in the facts
                    (not in the query) by another of the same length (niah_code: another
                    needle line in the needle's place), minus answer_nats: how many
                    nats the needle itself is worth to the model. Zero for a model that ignores
                    the context, positive for one that reads it; the fair, continuous score for
                    models too small to copy five digits exactly.
  retrieval_nats_se standard error of retrieval_nats over the examples (the task mean's: the
                    tasks' combined), so two checkpoints' figures can be told from noise
"""
from __future__ import annotations

import collections
import dataclasses
import random
from typing import Sequence

import numpy as np

from c2.evals import codebase_loss

TASKS = ("niah_single", "niah_multikey", "variable_tracking", "niah_code")
METRICS = ("accuracy", "answer_nats", "retrieval_nats")


@dataclasses.dataclass(frozen=True)
class Task:
  """One example: facts to hide in the haystack (in order), the query that ends the prompt, the
  answer, and `control_facts` (the facts with the asked value replaced) for retrieval_nats."""
  kind: str
  facts: tuple[str, ...]
  control_facts: tuple[str, ...]
  query: str
  answer: str


def _value(rng: random.Random, avoid: set) -> str:
  while True:
    value = str(rng.randrange(10_000, 100_000))
    if value not in avoid:
      avoid.add(value)
      return value


def _name(rng: random.Random, prefix: str, avoid: set) -> str:
  while True:
    name = prefix + "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3))
    if name not in avoid:
      avoid.add(name)
      return name


def make_task(kind: str, rng: random.Random, *, keys: int = 4, chains: int = 2,
              hops: int = 3, code_lines: Sequence[str] = ()) -> Task:
  """A task of `kind` (see the module docstring) drawn from `rng`; `answer` without its leading
  space."""
  values, names = set(), set()
  if kind == "niah_single":
    value = _value(rng, values)
    return Task(kind, (f"PASSKEY = {value}",), (f"PASSKEY = {_value(rng, values)}",),
                "PASSKEY =", value)
  if kind == "niah_multikey":
    pairs = [(_name(rng, "KEY_", names), _value(rng, values)) for _ in range(keys)]
    asked = rng.randrange(keys)
    control = list(pairs)
    control[asked] = (pairs[asked][0], _value(rng, values))
    return Task(kind, tuple(f"{k} = {v}" for k, v in pairs),
                tuple(f"{k} = {v}" for k, v in control),
                f"{pairs[asked][0]} =", pairs[asked][1])
  if kind == "variable_tracking":
    chains_ = [[_name(rng, "VAR_", names) for _ in range(hops + 1)] for _ in range(chains)]
    roots = [_value(rng, values) for _ in range(chains)]
    asked = rng.randrange(chains)
    control_root = _value(rng, values)
    # Interleave the chains, each in its own order: a random merge of the assignment lists.
    slots = [c for c in range(chains) for _ in range(hops + 1)]
    rng.shuffle(slots)
    facts, control, done = [], [], [0] * chains
    for c in slots:
      i, chain = done[c], chains_[c]
      rhs = roots[c] if i == 0 else chain[i - 1]
      facts.append(f"{chain[i]} = {rhs}")
      control.append(f"{chain[i]} = {control_root if (i == 0 and c == asked) else rhs}")
      done[c] += 1
    return Task(kind, tuple(facts), tuple(control),
                f"# variables equal to {roots[asked]}:", ", ".join(chains_[asked]))
  if kind == "niah_code":
    if not code_lines:
      raise ValueError("niah_code needs code_lines (see needle_lines) to draw its needle from")
    needle, other = rng.sample(code_lines, 2)
    return Task(kind, (needle,), (other,), *_split_needle(needle))
  raise ValueError(f"unknown RULER task {kind!r}; choose from {TASKS}")


def _split_needle(line: str) -> tuple[str, str]:
  """(query, answer) of a niah_code needle: the line up to its first space past a third of it,
  and the rest (after that space); ('', '') when there is no such space."""
  cut = line.find(" ", len(line) // 3)
  return (line[:cut], line[cut + 1:]) if cut > 0 else ("", "")


def needle_lines(filler: Sequence[str]) -> list[str]:
  """niah_code's needles: held-out code lines (stripped) of 40-70 characters with at least four
  words, two of them in the answer; not comments, nor codec table rows (predictable from their
  neighbours' pattern, not from the needle); each occurring once in `filler`, so that only the
  needle tells how it goes on."""
  counts = collections.Counter(line.strip() for line in filler)
  return sorted(line for line, count in counts.items()
                if count == 1 and 40 <= len(line) <= 70 and line.count(" ") >= 3
                and not line.startswith("#") and "  " not in line
                and not any(code in line for code in ("0x", "\\u", "\\x"))
                and " " in _split_needle(line)[1])


def render(task: Task, tokenizer, filler: Sequence[str], length: int, rng: random.Random,
           depth: float | None = None) -> tuple[list[int], list[int], list[int]]:
  """(prompt ids, control prompt ids, answer ids): [BOS] + haystack with the facts at seeded
  depths (within its first 80%, in order; or, given `depth`, all of them after the first lines
  holding that fraction of the haystack's tokens) + query, filled so that prompt + answer is at
  most `length` tokens and within a few lines of it. Prompt and control differ only in the
  facts."""
  answer = tokenizer.encode(" " + task.answer)
  start = rng.randrange(len(filler))
  # A haystack line equal to a fact would hold the needle in the control prompt too.
  facts = {f.strip() for f in task.facts + task.control_facts}
  lines = [filler[(start + i) % len(filler)] + "\n" for i in range(len(filler))
           if filler[(start + i) % len(filler)].strip() not in facts]
  # Line costs are summed, then the exact encoding trims the last lines (BPE may merge across
  # line ends, so the sum is only an estimate).
  budget = length - 1 - len(answer) - len(tokenizer.encode(task.query))
  budget -= sum(len(tokenizer.encode(f + "\n")) for f in task.facts)
  used, kept = 0, []
  for line in lines:
    used += len(tokenizer.encode(line))
    if used > budget:
      break
    kept.append(line)
  if depth is None:
    depths = sorted(rng.sample(range(max(int(0.8 * len(kept)), len(task.facts))),
                               len(task.facts)))
  else:  # every fact after the first haystack lines holding `depth` of the haystack's tokens
    costs = np.cumsum([0] + [len(tokenizer.encode(line)) for line in kept])
    depths = [int(np.searchsorted(costs, depth * costs[-1]))] * len(task.facts)

  def build(facts: Sequence[str], haystack: list[str]) -> list[int]:
    # Facts before haystack line `depth` (past the end once trimming shortened it), in order.
    at: dict[int, list[str]] = {}
    for line, fact in zip(depths, facts):
      at.setdefault(min(line, len(haystack)), []).append(fact + "\n")
    text = [piece for i in range(len(haystack) + 1)
            for piece in at.get(i, []) + haystack[i:i + 1]]
    return [tokenizer.bos_id] + tokenizer.encode("".join(text) + task.query)

  while True:
    prompt, control = build(task.facts, kept), build(task.control_facts, kept)
    if max(len(prompt), len(control)) + len(answer) <= length:
      return prompt, control, answer
    if not kept:
      raise ValueError(f"a {task.kind} task needs {len(prompt) + len(answer)} tokens without "
                       f"any haystack, more than the length {length}")
    kept = kept[:-1]


def answer_matches(completion: str, answer: str) -> bool:
  """Exact match of a greedy continuation (leading spaces dropped): the answer, then nothing
  that would extend it."""
  text = completion.lstrip(" ")
  if not text.startswith(answer):
    return False
  rest = text[len(answer):]
  return not rest or not (rest[0].isalnum() or rest[0] in "_,")


def score(probe, examples: Sequence[tuple[Task, list[int], list[int], list[int]]], length: int
          ) -> dict[str, float]:
  """accuracy, answer_nats and retrieval_nats (module docstring) over rendered examples."""
  prompts = [p for _, p, _, _ in examples]
  answers = [a for _, _, _, a in examples]
  completions = probe.complete(prompts, max_new_tokens=[len(a) + 2 for a in answers])
  correct = [answer_matches(probe.tokenizer.decode(c), t.answer)
             for c, (t, _, _, _) in zip(completions, examples)]
  nats = np.asarray(probe.answer_nats(prompts, answers, length=length))
  control = np.asarray(probe.answer_nats([c for _, _, c, _ in examples], answers, length=length))
  worth = control - nats
  se = float(worth.std(ddof=1) / np.sqrt(len(worth))) if len(worth) > 1 else float("nan")
  return {"accuracy": float(np.mean(correct)), "answer_nats": float(nats.mean()),
          "retrieval_nats": float(worth.mean()), "retrieval_nats_se": se}


def evaluate(probe, *, lengths: Sequence[int], examples: int, seed: int = 0,
             tasks: Sequence[str] = TASKS, keys: int = 4, chains: int = 2, hops: int = 3,
             code_depth: float = 0.1, text_bytes: int | None = None) -> dict[str, float]:
  """Suite scalars <task>/<metric>_len<L> and the task means <metric>_len<L>, `examples` per
  task and length; lengths longer than the probe's engine capacity are skipped, and so is a task
  whose facts alone do not fit a length."""
  filler = [l for l in codebase_loss.stdlib_text(max_bytes=text_bytes).splitlines() if l.strip()]
  code_lines = needle_lines(filler)
  out = {}
  for length in lengths:
    if length + 2 > probe.capacity:
      continue
    per_task = {}
    for kind in tasks:
      rng = random.Random(f"ruler-{kind}-{length}-{seed}")
      try:
        rendered = []
        for _ in range(examples):
          task = make_task(kind, rng, keys=keys, chains=chains, hops=hops, code_lines=code_lines)
          depth = code_depth if kind == "niah_code" else None
          rendered.append((task, *render(task, probe.tokenizer, filler, length, rng, depth)))
      except ValueError:  # the facts alone exceed this length: no score, rather than a wrong one
        continue
      per_task[kind] = score(probe, rendered, length)
      out.update({f"{kind}/{m}_len{length}": v for m, v in per_task[kind].items()})
    if per_task:
      out.update({f"{m}_len{length}": float(np.mean([s[m] for s in per_task.values()]))
                  for m in METRICS})
      out[f"retrieval_nats_se_len{length}"] = float(
          np.sqrt(sum(s["retrieval_nats_se"] ** 2 for s in per_task.values())) / len(per_task))
  return out
