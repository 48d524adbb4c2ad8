"""Records -> variable-length training examples {"tokens", "loss_mask"}, and cutting long ones.

An example is a pair of int32 arrays of equal length:
  tokens     the token ids of one document or conversation;
  loss_mask  1 where the token at that position is a valid *target* (for SFT: assistant tokens).
The packer (c2/data/packing.py) lays examples side by side into fixed-length rows; the model step
shifts targets within each document itself, so nothing here is shifted.

The transforms are module-level classes so grain worker processes can pickle them.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import grain
import numpy as np

from c2.data import chat, copy_drills
from c2.data.tokenizer import Tokenizer


def _example(tokens, loss_mask) -> dict[str, np.ndarray]:
  return {"tokens": np.asarray(tokens, np.int32), "loss_mask": np.asarray(loss_mask, np.int32)}


class DocumentToExample(grain.transforms.Map):
  """A text document as `[BOS] text [EOS]`, every token a target.

  EOS is a target so the model learns where documents end; BOS never is (the packer zeroes the
  first position of every segment, since nothing before it in the document predicts it).
  """

  def __init__(self, tokenizer: Tokenizer, text_field: str = "text"):
    self._tokenizer = tokenizer
    self._text_field = text_field

  def map(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    ids = [self._tokenizer.bos_id, *self._tokenizer.encode(record[self._text_field]),
           self._tokenizer.eos_id]
    return _example(ids, np.ones(len(ids), np.int32))


class DocumentOrCopyDrill(grain.transforms.RandomMap):
  """DocumentToExample, except that a `fraction` of the documents become copy drills
  (config.data.repeat_fraction), in one of two layouts (config.data.copy_drill_span):

  max_span 0, repeats: `[BOS] a a [EOS]`, `a` 8 to (max_tokens - 2) // 2 tokens drawn from the
  document's distinct tokens (without replacement where there are enough), so both copies land
  in one row of max_tokens; only the second copy and EOS carry loss.
  max_span N, needles: the document itself, its first max_tokens - 1 tokens after BOS, with a span
  of 8 to N of its tokens copied over a later stretch of it, anywhere up to the row's end; only
  the copy carries loss (its first token excepted: nothing predicts where a copy starts). The
  long-context phase's synthetic retrieval data: a needle in a haystack of real text, read back
  from as far as the row reaches, which natural documents alone teach too rarely (measured in
  experiments/extend_256k.py).

  Predicting a copy needs attention to the original (induction), the skill that copying a path
  or a name from the prompt into a tool call, or reading a needle back, rests on. The draws come
  from grain's per-element generator (seeded by the pipeline seed and the element's index), so a
  document gives a different drill on every pass: drills fixed per document were measured to be
  memorised by the tiny model (the small corpus is seen for epochs), teaching no copying; so
  were the document's own first tokens, repeated. A random length keeps the second copy from
  starting at a fixed position a fixed-offset head could exploit.
  """

  def __init__(self, tokenizer: Tokenizer, text_field: str = "text", *, fraction: float,
               max_tokens: int, max_span: int = 0):
    if max_span and not copy_drills.MIN_SPAN <= max_span <= (max_tokens - 1) // 2:
      raise ValueError(f"config.data.copy_drill_span={max_span} must be 0 or in "
                       f"[{copy_drills.MIN_SPAN}, {(max_tokens - 1) // 2}] (half a row of "
                       f"seq_len={max_tokens})")
    self._tokenizer, self._text_field = tokenizer, text_field
    self._fraction, self._max_tokens, self._max_span = fraction, max_tokens, max_span
    self._document = DocumentToExample(tokenizer, text_field)

  def random_map(self, record: Mapping[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    if rng.random() >= self._fraction:
      return self._document.map(record)
    body = self._tokenizer.encode(record[self._text_field])
    if self._max_span:
      if len(body) < 2 * copy_drills.MIN_SPAN:  # too short to hold a span and its copy
        return self._document.map(record)
      tokens = np.asarray(body[:self._max_tokens - 1], np.int32)
      mask = copy_drills.plant_copy(tokens, rng, far=True,
                                    max_span=min(self._max_span, len(tokens) // 2))
      return _example(np.concatenate([[self._tokenizer.bos_id], tokens]), mask)
    if not body:  # an empty document has no tokens to draw from: it stays a document
      return self._document.map(record)
    length = int(rng.integers(8, max(9, (self._max_tokens - 2) // 2 + 1)))
    distinct = np.unique(body)  # the document's own tokens, so no special ones
    part = rng.choice(distinct, size=length, replace=len(distinct) < length).tolist()
    ids = [self._tokenizer.bos_id, *part, *part, self._tokenizer.eos_id]
    # Loss on the second copy (and EOS) only: the first is random by design, and its loss
    # (about ln of the pool) would swamp the copying signal in the clipped gradient.
    mask = np.zeros(len(ids), np.int32)
    mask[1 + length:] = 1
    return _example(ids, mask)


def _maybe_json(value: Any) -> Any:
  # Parquet stores nested lists as structs, but corpora often keep them as JSON strings instead.
  return json.loads(value) if isinstance(value, str) else value


class ConversationToExample(grain.transforms.Map):
  """A {"messages": [...], "tools": [...]} record rendered by the Kimi template.

  Loss only on assistant replies of the current turn (after the last user message), rendered
  with their reasoning, as c2/data/chat.py describes; earlier turns are context.
  """

  def __init__(self, tokenizer: Tokenizer, *, train_on: str = "current_turn",
               default_system_prompt: str | None = chat.KIMI_DEFAULT_SYSTEM_PROMPT):
    self._tokenizer = tokenizer
    self._train_on = train_on
    self._default_system_prompt = default_system_prompt

  def map(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    rendered = chat.render_chat(
        self._tokenizer, _maybe_json(record["messages"]), _maybe_json(record.get("tools")),
        default_system_prompt=self._default_system_prompt,
        history_reasoning="current_turn", train_on=self._train_on)
    return _example(rendered.token_ids, rendered.assistant_mask)


class CutToLength(grain.experimental.FlatMapTransform):
  """Cuts examples longer than `max_length` into pieces that overlap by one token.

  Each piece becomes its own packed segment. The overlap makes the last token of one piece the
  first of the next, so every next-token transition of the original example is trained exactly
  once (a piece's first token is never a target).
  """

  def __init__(self, max_length: int):
    if max_length < 2:
      raise ValueError("pieces need at least two tokens to hold a transition")
    self._max_length = max_length
    # grain's FlatMap API asks for a fan-out bound; the iterator version does not enforce it.
    self.max_fan_out = 1 << 20

  def flat_map(self, example: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    length = len(example["tokens"])
    if length <= self._max_length:
      return [dict(example)]
    stride = self._max_length - 1
    starts = range(0, length - 1, stride)
    return [{key: value[start:start + self._max_length] for key, value in example.items()}
            for start in starts]
