"""State tracking: reconstruct a file after a chain of diffs (LoCoDiff-style), scored by the mean
character-level edit distance between the model's file and the true one (lower is better).

Composer 2's probe (report section 1.3, Table 2) replays many diffs of its monorepo and reports the
mean character distance, since exact match flips on a single wrong character. Here the files are
excerpts of the embedded corpus's held-out split and the diffs are seeded line edits (change a
number or a name, delete a line, insert a line seen elsewhere in the file), each rendered as a
unified diff against the previous version. The data depends only on the seed and sizes, never on
a tokenizer, so checkpoints with different vocabularies get the same examples.

Prompt (a base model continues it; no instructions needed):
    ### original
    <file>
    ### diff 1
    @@ -2,3 +2,3 @@ ...
    ### diff 2 ...
    ### after 3 diffs
and the completion up to the next "###" line is the answer. Beside the distance the suite
reports exact match, the distance of simply copying the original (the no-tracking baseline) and
the teacher-forced nats per byte of the true file (continuous, moves before the argmax does).
"""
from __future__ import annotations

import dataclasses
import difflib
import random
import re
import textwrap
from typing import Optional

import numpy as np

from c2.data import stdlib_corpus

_MARK = "###"
_PER_FILE = 8


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str
  target: str  # the file after every diff
  original: str


def edit_distance(a: str, b: str) -> int:
  """Levenshtein distance (insert, delete, substitute one character), O(len(a) * len(b))."""
  if len(a) < len(b):
    a, b = b, a
  previous = np.arange(len(b) + 1)
  codes_b = np.frombuffer(b.encode("utf-32-le"), np.uint32)
  for i, ch in enumerate(a, 1):
    substitute = previous[:-1] + (codes_b != ord(ch))
    current = np.empty_like(previous)
    current[0] = i
    # Deletions/substitutions come from the previous row; insertions run along this row, a
    # running minimum of (value - index), so the row is vectorised except that scan.
    current[1:] = np.minimum(previous[1:] + 1, substitute)
    current = np.minimum.accumulate(current - np.arange(len(b) + 1)) + np.arange(len(b) + 1)
    previous = current
  return int(previous[-1])


def _excerpts(num_lines: int, max_line_chars: int) -> list[list[str]]:
  """Disjoint runs of `num_lines` non-blank, short ASCII lines from the held-out files (at most
  `_PER_FILE` per file, so no one file dominates)."""
  out = []
  for path in stdlib_corpus.stdlib_files("heldout"):
    lines = stdlib_corpus.read_source(path).splitlines()
    found = 0
    for start in range(0, max(len(lines) - num_lines, 0), num_lines):
      run = lines[start:start + num_lines]
      if all(0 < len(l.strip()) and len(l) <= max_line_chars and l.isascii() for l in run):
        out.append(textwrap.dedent("\n".join(run)).split("\n"))  # indentation costs tokens
        found += 1
        if found == _PER_FILE:
          break
  return out


def _edit(lines: list[str], pool: list[str], rng: random.Random) -> list[str]:
  """One seeded line edit; returns the new version (always different from `lines`)."""
  lines = list(lines)
  while True:
    i = rng.randrange(len(lines))
    kind = rng.choice(("number", "name", "delete", "insert"))
    if kind == "delete" and len(lines) > 2:
      del lines[i]
      return lines
    if kind == "insert":
      lines.insert(i, rng.choice(pool))
      return lines
    if kind == "number":
      changed = re.sub(r"\d+", lambda m: str(rng.randrange(10, 1000)), lines[i], count=1)
      if changed == lines[i]:
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        changed = f"{indent}limit_{rng.randrange(10, 100)} = {rng.randrange(10, 1000)}"
    else:
      names = re.findall(r"[A-Za-z_][A-Za-z_0-9]{2,}", lines[i])
      changed = (lines[i].replace(rng.choice(names), f"{rng.choice(names)}_{rng.randrange(10)}", 1)
                 if names else lines[i] + "  # edited")
    if changed != lines[i]:
      lines[i] = changed
      return lines


def _diff(before: list[str], after: list[str]) -> str:
  hunks = difflib.unified_diff(before, after, lineterm="", n=1)
  return "\n".join(h for h in hunks if not h.startswith(("---", "+++")))


def build_examples(count: int, *, num_lines: int = 6, num_diffs: int = 3,
                   max_line_chars: int = 48, seed: int = 0) -> list[Example]:
  """`count` examples (fewer if the held-out split runs out of excerpts), deterministic."""
  excerpts = _excerpts(num_lines, max_line_chars)
  rng = random.Random(seed)
  rng.shuffle(excerpts)
  examples = []
  for lines in excerpts[:count]:
    versions = [lines]
    for _ in range(num_diffs):
      versions.append(_edit(versions[-1], lines, rng))
    parts = [f"{_MARK} original", *lines]
    for d in range(1, num_diffs + 1):
      parts += [f"{_MARK} diff {d}", _diff(versions[d - 1], versions[d])]
    parts.append(f"{_MARK} after {num_diffs} diffs\n")
    examples.append(Example("\n".join(parts), "\n".join(versions[-1]) + "\n",
                            "\n".join(lines) + "\n"))
  return examples


def answer_text(completion: str) -> str:
  """The completion up to the next `###` line (where the model would start a new section)."""
  cut = completion.find("\n" + _MARK)
  if completion.startswith(_MARK):
    return ""
  return completion if cut < 0 else completion[:cut + 1]


def evaluate(probe, examples: list[Example], *, extra_tokens: int = 16,
             capacity: Optional[int] = None) -> dict[str, float]:
  """Suite scalars for `examples` under a ProbeModel. Examples whose prompt + answer (+ slack)
  do not fit the probe's context are skipped and counted."""
  tok = probe.tokenizer
  limit = capacity or probe.context
  prompts, targets, kept = [], [], []
  for ex in examples:
    prompt = [tok.bos_id] + tok.encode(ex.prompt)
    target = tok.encode(ex.target)
    if len(prompt) + len(target) + extra_tokens <= limit:
      prompts.append(prompt)
      targets.append(target)
      kept.append(ex)
  if not kept:
    return {"skipped": float(len(examples))}
  # Each answer may run `extra_tokens` past its true length; the "###" line ends it earlier.
  completions = probe.complete(prompts, max_new_tokens=[len(t) + extra_tokens for t in targets])
  answers = [answer_text(tok.decode(ids)) for ids in completions]
  distances = [edit_distance(a, ex.target) for a, ex in zip(answers, kept)]
  nats = probe.answer_nats(prompts, targets, length=limit)
  target_bytes = sum(len(ex.target.encode()) for ex in kept)
  return {"char_distance": float(np.mean(distances)),
          "normalized_distance": float(np.mean([d / len(ex.target) for d, ex in
                                                zip(distances, kept)])),
          "exact_match": float(np.mean([a == ex.target for a, ex in zip(answers, kept)])),
          "copy_baseline_distance": float(np.mean([edit_distance(ex.original, ex.target)
                                                   for ex in kept])),
          "target_nats_per_byte": float(sum(nats) / target_bytes),
          "examples": float(len(kept)), "skipped": float(len(examples) - len(kept))}
