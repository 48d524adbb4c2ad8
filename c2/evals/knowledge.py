"""Knowledge probe: question/answer pairs scored by exact match of the greedy answer.

Composer 2's FreshBench asks coding-knowledge questions mined from agent traces and grades the
answers (report section 1.3). The format here is the minimal one a user fills with their own
pairs, one JSON object per line:

    {"question": "Which module defines the function `dedent`?", "answer": "textwrap"}

Each pair is asked as "# Q: <question>\\n# A: " (comment lines, so a code model reads it as code)
and the greedy completion up to the end of its line is compared with the answer, whitespace
stripped. Beside exact match the suite reports the teacher-forced nats per answer byte, which a
model improves long before its argmax answer becomes right.

Without a file, `builtin_pairs` asks which standard-library module defines a public module-level
function, from the embedded corpus's train split: knowledge that pretraining on it can hold.
"""
from __future__ import annotations

import collections
import json
import random
import re
from typing import Iterable, Optional

import numpy as np

from c2.data import stdlib_corpus

PROMPT = "# Q: {question}\n# A: "
_DEF = re.compile(r"^def ([a-zA-Z][a-zA-Z0-9_]*)\(", re.MULTILINE)


def read_pairs(path: str) -> list[dict]:
  """A JSONL file of {"question", "answer"} objects; the error names the line."""
  pairs = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not JSON ({e})") from None
      if not (isinstance(record, dict) and isinstance(record.get("question"), str)
              and isinstance(record.get("answer"), str) and record["answer"].strip()):
        raise ValueError(f'{path}:{number}: expected {{"question": str, "answer": non-empty str}}')
      pairs.append({"question": record["question"], "answer": record["answer"].strip()})
  return pairs


def builtin_pairs(count: int, seed: int = 0) -> list[dict]:
  """`count` questions "which module defines `f`" for functions defined in exactly one module."""
  root = stdlib_corpus.stdlib_root()
  modules = collections.defaultdict(set)
  for path in stdlib_corpus.stdlib_files("train"):
    module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
    module = module.removesuffix(".__init__")
    for name in _DEF.findall(stdlib_corpus.read_source(path)):
      modules[name].add(module)
  unique = sorted((name, next(iter(m))) for name, m in modules.items() if len(m) == 1)
  chosen = random.Random(seed).sample(unique, min(count, len(unique)))
  return [{"question": f"Which standard-library module defines the function `{name}`?",
           "answer": module} for name, module in chosen]


def _first_line(text: str) -> str:
  return text.split("\n", 1)[0].strip()


def evaluate(probe, pairs: Iterable[dict], *, max_answer_tokens: Optional[int] = None
             ) -> dict[str, float]:
  """Suite scalars: exact_match, answer_nats_per_byte, questions."""
  tok = probe.tokenizer
  pairs = list(pairs)
  prompts = [[tok.bos_id] + tok.encode(PROMPT.format(question=p["question"])) for p in pairs]
  answers = [tok.encode(p["answer"]) for p in pairs]
  longest = max_answer_tokens or max(len(a) for a in answers) + 4
  fits = [len(p) + longest <= probe.capacity and len(p) + len(a) <= probe.context
          for p, a in zip(prompts, answers)]
  prompts = [p for p, ok in zip(prompts, fits) if ok]
  answers = [a for a, ok in zip(answers, fits) if ok]
  pairs = [p for p, ok in zip(pairs, fits) if ok]
  if not pairs:
    return {"questions": 0.0}
  completions = probe.complete(prompts, max_new_tokens=longest)
  correct = [_first_line(tok.decode(c)) == p["answer"] for c, p in zip(completions, pairs)]
  nats = probe.answer_nats(prompts, answers)
  answer_bytes = sum(len(p["answer"].encode()) for p in pairs)
  return {"exact_match": float(np.mean(correct)),
          "answer_nats_per_byte": float(sum(nats) / answer_bytes),
          "questions": float(len(pairs))}
