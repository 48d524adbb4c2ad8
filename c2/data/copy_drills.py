"""Copy drills over the tokens a policy copies: rows where a span of tokens appears twice.

The agentic tasks are solved by copying: a path from the prompt into a tool call, a line of a
file into an edit's search text. A model copies an arbitrary span only once it has an induction
circuit (a previous-token head feeding a head that looks up "the token after the one I just
wrote"), and the tiny model's CPU minutes of code pretraining do not form one: after SFT it writes
the first token of every copied span at 2-3 nats and the rest by bigram guesses (measured on
held-out oracle transcripts, README "Agentic RL").

Drills make the copy the only way to lower the loss. A row is `[BOS]` and row_tokens - 1 tokens
drawn from an alphabet; a span of 8 to (row_tokens - 1) // 2 tokens, at a random place, is
followed by itself, and only the copy carries loss (its first token excepted: nothing predicts
where a copy starts). Far drills (max_span > 0) copy a span of up to max_span tokens to any later
place in the row, as a tool call copies from a prompt or a file read hundreds of tokens back.
Measured on the tiny preset from the tiny pretraining checkpoint (rows of 48, batch 32, lr 1e-3):
the copy loss stays near the alphabet's entropy for ~1,500 steps and then drops within ~250
steps to ~0.1 nats, the transition of an induction circuit forming. The circuit copies only what
it was drilled on: a 62-token alphabet's circuit gives 11.6 nats on the whole vocabulary, and
this one gives 7.9 / 10.6 nats on spans copied up to 128 / 512 tokens away. So the alphabet is
the one the tasks need, the tokens of the oracle's tool-call arguments (`tool_call_alphabet`),
drawn with probability ~ count ** temperature (0.5: rare pieces of names and paths are the
copies that matter, frequent JSON punctuation is easy), and far drills follow.

Source spec `copy_drills:PATTERN[,PATTERN]` (c2/data/sources.py): the transcript files the
alphabet comes from; both splits use the same alphabet, with different draws.
"""
from __future__ import annotations

import collections
import json
from typing import Any, Mapping, Sequence

import grain
import numpy as np

from c2.data.tokenizer import Tokenizer

MIN_SPAN = 8
DRILLS_PER_EPOCH = 1 << 30  # indices of the source; drills are drawn from (seed, split, index)
_SPLIT_SALT = {"train": 0, "heldout": 1}


class DrillIndexSource:
  """A random-access source of drill records {"drill": index, "salt": split}: the drill itself is
  drawn by CopyDrill, which needs the tokenizer and the alphabet."""

  def __init__(self, split: str):
    if split not in _SPLIT_SALT:
      raise ValueError(f"copy drills have the splits {sorted(_SPLIT_SALT)}, not {split!r}")
    self._salt = _SPLIT_SALT[split]

  def __len__(self) -> int:
    return DRILLS_PER_EPOCH

  def __getitem__(self, index: int) -> dict[str, int]:
    return {"drill": int(index), "salt": self._salt}


def tool_call_alphabet(records: Sequence[Mapping[str, Any]],
                       tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, counts) over the tool-call arguments of chat records, most frequent first."""
  counts: collections.Counter = collections.Counter()
  for record in records:
    messages = record["messages"]
    messages = json.loads(messages) if isinstance(messages, str) else messages
    for message in messages:
      for call in message.get("tool_calls") or ():
        arguments = call["function"]["arguments"]
        if not isinstance(arguments, str):
          arguments = json.dumps(arguments)
        counts.update(tokenizer.encode(arguments))
  if not counts:
    raise ValueError("copy drills: the transcripts hold no tool calls to take an alphabet from; "
                     "give oracle transcripts (python -m c2.envs.transcripts)")
  ranked = counts.most_common()
  return (np.array([token for token, _ in ranked], np.int32),
          np.array([count for _, count in ranked], np.int64))


def plant_copy(tokens: np.ndarray, rng: np.random.Generator, *, max_span: int,
               far: bool) -> np.ndarray:
  """Copies a span of MIN_SPAN to max_span of `tokens` over a later stretch of them, in place:
  right after itself, or (far) anywhere later. Returns the loss mask of the row `[BOS] tokens`:
  the copy after its first token (nothing predicts where a copy starts)."""
  n = len(tokens)
  span = int(rng.integers(MIN_SPAN, max_span + 1))
  start = int(rng.integers(0, n - 2 * span + 1))
  copy = start + span  # where the copy starts
  if far:
    copy += int(rng.integers(0, n - 2 * span - start + 1))
  tokens[copy:copy + span] = tokens[start:start + span]
  mask = np.zeros(n + 1, np.int32)  # positions count from BOS at 0
  mask[1 + copy + 1:1 + copy + span] = 1
  return mask


class CopyDrill(grain.transforms.Map):
  """DrillIndexSource records -> {"tokens", "loss_mask"} rows of exactly row_tokens tokens.

  Each drill is drawn from its own generator, seeded by (seed, split, index), so a resumed or
  re-sharded run sees the same drills and the held-out split never repeats a training drill.
  """

  def __init__(self, tokenizer: Tokenizer, ids: np.ndarray, counts: np.ndarray, *,
               row_tokens: int, seed: int, max_span: int = 0, temperature: float = 0.5):
    """max_span 0: spans of up to half the row, copied right after themselves; N: spans of up to
    N tokens, copied anywhere later in the row (far copies)."""
    if max_span and max_span < MIN_SPAN:
      raise ValueError(f"config.data.copy_drill_span={max_span} must be 0 or >= {MIN_SPAN}")
    if row_tokens < 2 * max(MIN_SPAN, max_span) + 2:
      raise ValueError(f"config.data.seq_len={row_tokens} is too short for copy drills: a row "
                       f"holds [BOS] and two copies of up to {max(MIN_SPAN, max_span)} tokens "
                       f"(seq_len >= {2 * max(MIN_SPAN, max_span) + 2})")
    weights = np.asarray(counts, np.float64) ** temperature
    self._ids, self._probs = np.asarray(ids, np.int32), weights / weights.sum()
    self._bos, self._row_tokens, self._seed = tokenizer.bos_id, row_tokens, seed
    self._max_span = max_span

  def map(self, record: Mapping[str, int]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self._seed, record["salt"], record["drill"]])
    body = self._row_tokens - 1
    tokens = self._ids[rng.choice(len(self._ids), size=body, p=self._probs)]
    mask = plant_copy(tokens, rng, max_span=self._max_span or body // 2, far=bool(self._max_span))
    return {"tokens": np.concatenate([[self._bos], tokens]).astype(np.int32), "loss_mask": mask}

  def alphabet_entropy(self) -> float:
    """Nats per token of guessing from the drawing distribution: a drill's loss before copying."""
    return float(-(self._probs * np.log(self._probs)).sum())
