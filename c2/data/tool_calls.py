"""Parses a generated Kimi assistant reply back into reasoning, content and OpenAI tool calls.

The inverse of the assistant part of c2/data/chat.py. A reply, as generated after the
`<|im_assistant|>assistant<|im_middle|>` header, is
  [<think>]{reasoning}</think>{content}
  [<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>
   {JSON args}<|tool_call_end|>...<|tool_calls_section_end|>]<|im_end|>
When the generation prompt already ends with `<think>` (thinking mode, chat.py's default), the
reply starts inside the reasoning: pass `in_reasoning=True`.

Structure is read from special-token *ids* (`parse_assistant_ids`), never from text, for the same
reason the renderer inserts them by id: a model or user writing "<|tool_call_begin|>" as ordinary
characters must not open a tool call. `parse_assistant_text` reads template text (special tokens
written by name) for logs and tests. The parser is lenient, because sampled text is arbitrary: a
structural token out of place is rendered by name into whatever field is open, a call cut short
(by max_tokens) is returned with `complete=False`, and anything after `<|im_end|>` is ignored.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional, Sequence

from c2.data import kimi_vocab
from c2.data.tokenizer import Tokenizer

# The tokens that give a reply its structure; every other special token is text to the parser.
STRUCTURAL_TOKENS = (
    kimi_vocab.THINK_BEGIN, kimi_vocab.THINK_END, kimi_vocab.TOOL_CALLS_SECTION_BEGIN,
    kimi_vocab.TOOL_CALLS_SECTION_END, kimi_vocab.TOOL_CALL_BEGIN,
    kimi_vocab.TOOL_CALL_ARGUMENT_BEGIN, kimi_vocab.TOOL_CALL_END, kimi_vocab.IM_END,
    kimi_vocab.EOS)
_STRUCTURAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in STRUCTURAL_TOKENS) + ")")


@dataclasses.dataclass
class ToolCall:
  id: str  # "functions.{name}:{index}", as Kimi writes it
  arguments: str  # JSON text as generated (not validated: the client decides what to do with it)
  complete: bool = False  # saw <|tool_call_end|>

  @property
  def name(self) -> str:
    """"functions.get_weather:0" -> "get_weather" (ids without the prefix/suffix kept whole)."""
    name = self.id.split(".", 1)[1] if self.id.startswith("functions.") else self.id
    head, sep, index = name.rpartition(":")
    return head if sep and index.isdigit() else name

  def to_openai(self) -> dict:
    return {"id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ParsedReply:
  reasoning: str = ""
  content: str = ""
  tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
  ended: bool = False  # saw <|im_end|> or [EOS]

  def openai_tool_calls(self) -> list[dict]:
    return [call.to_openai() for call in self.tool_calls]


def parse_pieces(pieces: Iterable[tuple[bool, str]], *, in_reasoning: bool = False
                 ) -> ParsedReply:
  """pieces: (is_structural_special, text) in order; text of a special is its name."""
  reply = ParsedReply()
  field = "reasoning" if in_reasoning else "content"  # where ordinary text goes
  call: Optional[ToolCall] = None
  call_id = None  # text of a call id being read (between call begin and argument begin)

  def append_text(text: str):
    nonlocal call_id
    if call_id is not None:
      call_id += text
    elif call is not None and not call.complete:
      call.arguments += text
    elif field != "section":
      setattr(reply, field, getattr(reply, field) + text)
    # Text between calls inside the section (e.g. newlines) carries nothing: dropped.

  for is_special, text in pieces:
    if not is_special:
      append_text(text)
    elif text in (kimi_vocab.IM_END, kimi_vocab.EOS):
      reply.ended = True
      break
    elif text == kimi_vocab.THINK_BEGIN and field == "content" and not reply.reasoning:
      field = "reasoning"
    elif text == kimi_vocab.THINK_END and field == "reasoning":
      field = "content"
    elif text == kimi_vocab.TOOL_CALLS_SECTION_BEGIN and field != "section":
      field, call = "section", None
    elif text == kimi_vocab.TOOL_CALL_BEGIN and call_id is None:
      field, call, call_id = "section", None, ""
    elif text == kimi_vocab.TOOL_CALL_ARGUMENT_BEGIN and call_id is not None:
      call = ToolCall(call_id.strip(), "")
      reply.tool_calls.append(call)
      call_id = None
    elif text == kimi_vocab.TOOL_CALL_END and call is not None and not call.complete:
      call.complete = True
    elif text == kimi_vocab.TOOL_CALLS_SECTION_END and field == "section" and call_id is None:
      field = "content"
    else:
      append_text(text)
  return reply


def _id_pieces(tokenizer: Tokenizer, ids: Sequence[int]) -> Iterable[tuple[bool, str]]:
  names = {}
  for name in STRUCTURAL_TOKENS:
    try:
      names[tokenizer.special_id(name)] = name
    except KeyError:  # a foreign vocabulary without e.g. <think>: that token never occurs
      pass
  run: list[int] = []
  for token in ids:
    if int(token) in names:
      if run:
        yield False, tokenizer.decode(run)
        run = []
      yield True, names[int(token)]
    else:
      run.append(int(token))
  if run:
    yield False, tokenizer.decode(run)


def parse_assistant_ids(tokenizer: Tokenizer, ids: Sequence[int], *, in_reasoning: bool = False
                        ) -> ParsedReply:
  """Generated token ids (after the assistant header) -> ParsedReply; runs of ordinary ids are
  decoded together, so multi-token characters come out whole."""
  return parse_pieces(_id_pieces(tokenizer, ids), in_reasoning=in_reasoning)


def parse_assistant_text(text: str, *, in_reasoning: bool = False) -> ParsedReply:
  """Template text (special tokens written by name) -> ParsedReply."""
  pieces = ((i % 2 == 1, part) for i, part in enumerate(_STRUCTURAL_SPLIT.split(text)) if part)
  return parse_pieces(pieces, in_reasoning=in_reasoning)


def format_assistant_text(content: str = "", tool_calls: Sequence[tuple[str, str]] = (), *,
                          reasoning: str = "", in_reasoning: bool = False) -> str:
  """The inverse of `parse_assistant_text`: a reply as template text, ending with <|im_end|>.
  tool_calls: (name, JSON arguments) pairs, numbered in order as Kimi does. in_reasoning: the
  generation prompt already opened <think>, so the reply starts with the reasoning itself."""
  text = ("" if in_reasoning else kimi_vocab.THINK_BEGIN) + reasoning + kimi_vocab.THINK_END
  text += content
  if tool_calls:
    text += kimi_vocab.TOOL_CALLS_SECTION_BEGIN + "".join(
        f"{kimi_vocab.TOOL_CALL_BEGIN}functions.{name}:{i}{kimi_vocab.TOOL_CALL_ARGUMENT_BEGIN}"
        f"{arguments}{kimi_vocab.TOOL_CALL_END}" for i, (name, arguments) in enumerate(tool_calls))
    text += kimi_vocab.TOOL_CALLS_SECTION_END
  return text + kimi_vocab.IM_END
