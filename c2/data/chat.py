"""Kimi's chat and tool-call template: the only place that knows how a conversation is laid out.

Layout (research/kimi_config.md; Kimi-K2-Thinking / K2.5 `chat_template.jinja`). Turns are
concatenated with no separator:
  [tools]      <|im_system|>tool_declare<|im_middle|>{tools as JSON}<|im_end|>
  [no system]  <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  system/user  <|im_system|>system<|im_middle|>{content}<|im_end|>   (<|im_user|>user... for users)
  assistant    <|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>{content}
                 [<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{i}
                  <|tool_call_argument_begin|>{JSON args}<|tool_call_end|>...<|tool_calls_section_end|>]
               <|im_end|>
  tool result  <|im_system|>{name or "tool"}<|im_middle|>## Return of {call id}\n{content}<|im_end|>
A message's `name`, when given, replaces the role name in its header. The template keeps
`reasoning_content` only for assistant messages *after* the last assistant message without tool
calls; earlier ones render an empty `<think></think>`.

Deviation, by choice: K2.5 declares tools as a TypeScript namespace built by Python code outside the
template; we always use the JSON declaration (the template's own fallback, and K2's format).

Messages are dicts in the OpenAI style: role in {system, user, assistant, tool}; content a string,
None or a list of {"type": "text", "text": ...} parts; assistants may carry `reasoning_content`
(alias `reasoning`) and `tool_calls` [{"id": ..., "function": {"name": ..., "arguments": str|dict}}].

Special tokens are emitted by id, never by parsing text, so message text cannot forge a turn.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from c2.data import kimi_vocab
from c2.data.tokenizer import Tokenizer

KIMI_DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
_ROLE_TOKENS = {"user": kimi_vocab.IM_USER, "assistant": kimi_vocab.IM_ASSISTANT}
HISTORY_REASONING_MODES = ("template", "current_turn")
TRAIN_ON_MODES = ("all_assistant", "current_turn")


@dataclasses.dataclass(frozen=True)
class Segment:
  """A run of rendered text: either one special token (by name) or ordinary text."""

  text: str
  is_special: bool
  trainable: bool  # part of an assistant reply that the loss should cover


@dataclasses.dataclass(frozen=True)
class RenderedChat:
  token_ids: list[int]
  assistant_mask: list[bool]  # per token: True on trained assistant tokens


def _content_text(content: Any) -> str:
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  texts = []
  for part in content:
    if part.get("type", "text") != "text":
      raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
    texts.append(part["text"])
  return "".join(texts)


def _json(value: Any) -> str:
  # The template's `tojson` under Hugging Face: json.dumps with ensure_ascii=False, default
  # separators, keys in insertion order.
  return json.dumps(value, ensure_ascii=False)


def _index_after(messages: Sequence[Mapping], is_boundary) -> int:
  """Index just after the last message matching is_boundary (0 if none)."""
  for index in range(len(messages) - 1, -1, -1):
    if is_boundary(messages[index]):
      return index + 1
  return 0


def chat_segments(messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, *,
                  default_system_prompt: str | None = KIMI_DEFAULT_SYSTEM_PROMPT,
                  history_reasoning: str = "template", train_on: str = "all_assistant",
                  add_generation_prompt: bool = False, thinking: bool = True) -> list[Segment]:
  """Renders a conversation to segments; render_chat_text / render_chat turn them into text / ids.

  Args:
    history_reasoning: "template" keeps reasoning only after the last assistant message without
      tool calls (exactly the Jinja template, i.e. what the model sees at inference); "current_turn"
      keeps it for every assistant message after the last user message, so SFT data can teach the
      reasoning of the final answer.
    train_on: which assistant replies are marked trainable: all of them, or only those after the
      last user message (earlier replies then serve as context, rendered as at inference).
    add_generation_prompt: append an open assistant header, with `<think>` when `thinking` (K2.5's
      default) or an empty `<think></think>` otherwise.
    default_system_prompt: inserted when the first message is not a system message (None: never).
  """
  if history_reasoning not in HISTORY_REASONING_MODES or train_on not in TRAIN_ON_MODES:
    raise ValueError(f"history_reasoning in {HISTORY_REASONING_MODES}, train_on in {TRAIN_ON_MODES}")
  after_last_user = _index_after(messages, lambda m: m["role"] == "user")
  if history_reasoning == "template":
    keep_reasoning_from = _index_after(
        messages, lambda m: m["role"] == "assistant" and not m.get("tool_calls"))
  else:
    keep_reasoning_from = after_last_user
  train_from = 0 if train_on == "all_assistant" else after_last_user

  segments: list[Segment] = []

  def special(name: str, trainable: bool = False):
    segments.append(Segment(name, True, trainable))

  def text(value: str, trainable: bool = False):
    if value:
      segments.append(Segment(value, False, trainable))

  def header(role_token: str, role_name: str):
    special(role_token)
    text(role_name)
    special(kimi_vocab.IM_MIDDLE)

  if tools:
    header(kimi_vocab.IM_SYSTEM, "tool_declare")
    text(_json(list(tools)))
    special(kimi_vocab.IM_END)
  if default_system_prompt is not None and (not messages or messages[0]["role"] != "system"):
    header(kimi_vocab.IM_SYSTEM, "system")
    text(default_system_prompt)
    special(kimi_vocab.IM_END)

  pending_call_ids: list[str] = []  # tool results answer calls in order, as in the template
  unnamed_calls = 0
  for index, message in enumerate(messages):
    role = message["role"]
    header(_ROLE_TOKENS.get(role, kimi_vocab.IM_SYSTEM), message.get("name") or role)
    if role == "assistant":
      # "weight": 0 (OpenAI's fine-tuning format) keeps a reply as context without training on
      # it, e.g. a deliberately wrong tool call that a recovery transcript answers with an error.
      weight = 1 if message.get("weight") is None else message["weight"]  # None: Parquet's absent
      if weight not in (0, 1):
        raise ValueError(f"message {index}: an assistant message's weight is 0 or 1 (OpenAI's "
                         f"fine-tuning format), got {weight!r}")
      trained = index >= train_from and weight == 1
      # `or`, not a .get default: Parquet rows carry absent keys as None.
      reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
      special(kimi_vocab.THINK_BEGIN, trained)
      text(reasoning if index >= keep_reasoning_from else "", trained)
      special(kimi_vocab.THINK_END, trained)
      text(_content_text(message.get("content")), trained)
      if message.get("tool_calls"):
        special(kimi_vocab.TOOL_CALLS_SECTION_BEGIN, trained)
        for call in message["tool_calls"]:
          function = call["function"]
          call_id = call.get("id")
          if call_id is None:
            call_id = f"functions.{function['name']}:{unnamed_calls}"
            unnamed_calls += 1
          pending_call_ids.append(call_id)
          arguments = function["arguments"]
          special(kimi_vocab.TOOL_CALL_BEGIN, trained)
          text(call_id, trained)
          special(kimi_vocab.TOOL_CALL_ARGUMENT_BEGIN, trained)
          text(arguments if isinstance(arguments, str) else _json(arguments), trained)
          special(kimi_vocab.TOOL_CALL_END, trained)
        special(kimi_vocab.TOOL_CALLS_SECTION_END, trained)
      special(kimi_vocab.IM_END, trained)
    elif role == "tool":
      if pending_call_ids:
        call_id = pending_call_ids.pop(0)
      else:
        call_id = f"functions.{message.get('name') or 'unknown'}:{unnamed_calls}"
      text(f"## Return of {call_id}\n{_content_text(message.get('content'))}")
      special(kimi_vocab.IM_END)
    else:
      text(_content_text(message.get("content")))
      special(kimi_vocab.IM_END)

  if add_generation_prompt:
    header(kimi_vocab.IM_ASSISTANT, "assistant")
    special(kimi_vocab.THINK_BEGIN)
    if not thinking:
      special(kimi_vocab.THINK_END)
  return segments


def render_chat_text(messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                     **options) -> str:
  """The conversation as the template's text (special tokens written by name)."""
  return "".join(segment.text for segment in chat_segments(messages, tools, **options))


def render_chat(tokenizer: Tokenizer, messages: Sequence[Mapping],
                tools: Sequence[Mapping] | None = None, **options) -> RenderedChat:
  """Token ids of the conversation and a per-token mask of trained assistant tokens.

  The mask covers an assistant reply's body, tool calls and closing `<|im_end|>`, never its
  `<|im_assistant|>assistant<|im_middle|>` header, and nothing outside assistant replies.
  """
  segments = chat_segments(messages, tools, **options)
  ids: list[int] = []
  mask: list[bool] = []
  pending_text = ""
  pending_trainable = False

  def flush_text():
    # Adjacent text segments are encoded together, as tokenizing the full template string would.
    nonlocal pending_text
    if pending_text:
      encoded = tokenizer.encode(pending_text)
      ids.extend(encoded)
      mask.extend([pending_trainable] * len(encoded))
      pending_text = ""

  for segment in segments:
    if segment.is_special:
      flush_text()
      ids.append(tokenizer.special_id(segment.text))
      mask.append(segment.trainable)
    else:
      if pending_text and segment.trainable != pending_trainable:
        raise AssertionError("a text run mixes trained and untrained segments")
      pending_text += segment.text
      pending_trainable = segment.trainable
  flush_text()
  return RenderedChat(ids, mask)


def render_generation_prompt(tokenizer: Tokenizer, messages: Sequence[Mapping],
                             tools: Sequence[Mapping] | None = None, *, thinking: bool = True,
                             **options) -> list[int]:
  """Token ids to generate the next assistant reply from: the conversation as the model saw it in
  training (`history_reasoning="template"`, i.e. the Jinja template) plus an open
  `<|im_assistant|>assistant<|im_middle|><think>` header (`<think></think>` without thinking).
  The reply then starts inside the reasoning iff `thinking`: parse it with
  `c2.data.tool_calls.parse_assistant_ids(..., in_reasoning=thinking)`."""
  return render_chat(tokenizer, messages, tools, add_generation_prompt=True, thinking=thinking,
                     **options).token_ids
