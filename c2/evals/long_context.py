"""Long-context suites, shared with the long-context phase: loss by position, and retrieval
(a needle; two-hop variable tracking) by context length.

  loss by position   rows of L tokens of held-out code ([BOS] first); the mean NLL of the tokens
                     at positions [2^i, 2^(i+1)). A model that uses its context has NLL falling
                     with position; past the trained length it rises (RoPE out of range).
  needle             filler code with `PASSKEY = 48213` at a seeded depth, ending in
                     `assert PASSKEY == `; the answer is the number.
  variables          `var_ab = 48213` early, `var_cd = var_ab` later, ending `assert var_cd == `:
                     two hops of the kind a long agentic trace needs (where was this set?).
Lengths are in the evaluated tokenizer's tokens (that is what the context holds). Per length: the
greedy answer's exact match and the teacher-forced nats of the answer.
"""
from __future__ import annotations

import random
import re
from typing import Optional, Sequence

import numpy as np

from c2.evals import codebase_loss


def position_buckets(length: int) -> list[tuple[int, int]]:
  """[1, 2), [2, 4), ... [2^i, min(2^(i+1), length)): positions 1..length-1 (0 is BOS)."""
  out, lo = [], 1
  while lo < length:
    out.append((lo, min(2 * lo, length)))
    lo *= 2
  return out


def loss_by_position(probe, token_ids: Sequence[int], length: int, rows: int) -> dict[str, float]:
  """Mean NLL per position bucket over `rows` disjoint rows of `length` tokens ([BOS] + text)."""
  bos = probe.tokenizer.bos_id
  data = [[bos] + list(token_ids[i * (length - 1):(i + 1) * (length - 1)]) for i in range(rows)]
  data = [r for r in data if len(r) == length]  # the text may hold fewer rows than asked
  if not data:
    return {"position_rows": 0.0}
  nll = -np.stack(probe.logprobs(data, length=length))  # [rows, length]
  out = {f"nll_pos{lo}": float(nll[:, lo:hi].mean()) for lo, hi in position_buckets(length)}
  return {**out, "position_rows": float(len(data))}


def _filler_lines(text: str) -> list[str]:
  return [l for l in text.splitlines() if l.strip()]


def build_retrieval(kind: str, tokenizer, filler: list[str], length: int, count: int,
                    seed: int) -> list[tuple[str, str]]:
  """(prompt, answer) pairs of about `length` tokens (prompt + answer <= length)."""
  rng = random.Random(f"{kind}-{length}-{seed}")
  out = []
  for _ in range(count):
    value = str(rng.randrange(10_000, 100_000))
    names = [f"var_{rng.choice('abcdefgh')}{rng.choice('ijklmnop')}{i}" for i in range(2)]
    if kind == "needle":
      facts, query = [f"PASSKEY = {value}"], "assert PASSKEY == "
    elif kind == "variables":
      facts, query = [f"{names[0]} = {value}", f"{names[1]} = {names[0]}"], f"assert {names[1]} == "
    else:
      raise ValueError(f"unknown retrieval kind {kind!r}")
    budget = length - len(tokenizer.encode(value)) - len(tokenizer.encode(query)) - 2
    budget -= sum(len(tokenizer.encode(f + "\n")) for f in facts)
    start = rng.randrange(len(filler))
    lines, used = [], 0
    for i in range(len(filler)):
      line = filler[(start + i) % len(filler)] + "\n"
      cost = len(tokenizer.encode(line))
      if used + cost > budget:
        break
      lines.append(line)
      used += cost
    # Facts at seeded depths in the first 80% (in order), so the query is never right after one.
    depths = sorted(rng.sample(range(max(int(0.8 * len(lines)), len(facts))), len(facts)))
    for depth, fact in sorted(zip(depths, facts), reverse=True):
      lines.insert(depth, fact + "\n")
    out.append(("".join(lines) + query, value))
  return out


def retrieval_scores(probe, pairs: list[tuple[str, str]], length: int) -> dict[str, float]:
  tok = probe.tokenizer
  prompts = [[tok.bos_id] + tok.encode(p) for p, _ in pairs]
  answers = [tok.encode(a) for _, a in pairs]
  keep = [len(p) + len(a) <= length and len(p) + len(a) + 2 <= probe.capacity
          for p, a in zip(prompts, answers)]
  prompts = [p for p, k in zip(prompts, keep) if k]
  answers = [a for a, k in zip(answers, keep) if k]
  pairs = [p for p, k in zip(pairs, keep) if k]
  if not pairs:
    return {}
  completions = probe.complete(prompts, max_new_tokens=max(len(a) for a in answers) + 2)
  got = [re.match(r"\d*", tok.decode(c).strip()).group(0) for c in completions]
  nats = probe.answer_nats(prompts, answers, length=length)
  return {"accuracy": float(np.mean([g == a for g, (_, a) in zip(got, pairs)])),
          "answer_nats": float(np.mean(nats))}


def evaluate(probe, *, lengths: Sequence[int], examples: int, position_rows: int,
             seed: int = 0, text_bytes: Optional[int] = None) -> dict[str, float]:
  """Suite scalars: nll_pos<i> (positions [i, 2i)) at the longest length over position_rows
  rows of the held-out corpus (all of it by default: 200 kB, ~60k tokens of the default
  tokenizer, so very long rows need a larger corpus), and
  <kind>/accuracy_len<L>, <kind>/answer_nats_len<L> for every length L. (No "@" in names:
  TensorBoard rewrites it to "_", and the JSON and TensorBoard names should agree.)"""
  text = codebase_loss.stdlib_text(max_bytes=text_bytes)
  ids = probe.tokenizer.encode(text)
  out = loss_by_position(probe, ids, max(lengths), position_rows)
  filler = _filler_lines(text)
  for kind in ("needle", "variables"):
    for length in lengths:
      pairs = build_retrieval(kind, probe.tokenizer, filler, length, examples, seed)
      for name, value in retrieval_scores(probe, pairs, length).items():
        out[f"{kind}/{name}_len{length}"] = value
  return out
