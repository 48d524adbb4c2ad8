"""The OpenAI wire format: request JSON -> engine Request, engine events -> response JSON / chunks.

Pure functions and small stateful formatters, no I/O: c2/infer/server.py moves the bytes. Chat
prompts are rendered and replies parsed by c2/data/chat.py and c2/data/tool_calls.py, the same
code the SFT data goes through, so the server and training agree on the template.

Streaming re-parses the whole reply after every engine event and sends what grew. Text still
able to change is held back: a trailing U+FFFD (half of a multi-byte character) and, when stop
strings are set, the last len(longest stop) - 1 characters (they may become a stop string, which
OpenAI leaves out of the text).
"""
from __future__ import annotations

import dataclasses
import secrets
import time
import uuid
from typing import Any, Optional, Sequence

from c2.data import chat, kimi_vocab, tool_calls
from c2.data.tokenizer import Tokenizer
from c2.infer.engine import Request, Result
from c2.infer.sampling import SamplingParams

ROLES = ("system", "user", "assistant", "tool")


class ApiError(Exception):
  """Becomes {"error": {"message", "type"}} with an HTTP status."""

  def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.kind = status, kind

  def body(self) -> dict:
    return {"error": {"message": str(self), "type": self.kind, "code": self.status}}


@dataclasses.dataclass
class Prepared:
  """A validated request: what to run and how to answer."""
  kind: str  # "chat" | "text"
  request: Request
  stream: bool
  include_usage: bool
  logprobs: bool
  in_reasoning: bool = False  # chat: the prompt ends inside <think>


def _get(body: dict, key: str, types, default=None, check=None, what: str = ""):
  value = body.get(key, default)
  if value is None:
    return default
  # bool is an int in Python, but `"max_tokens": true` is a client bug worth reporting.
  if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
    raise ApiError(f"'{key}' must be {what or _tuple(types)[0].__name__}, got {value!r}")
  if check is not None and not check(value):
    raise ApiError(f"'{key}' must be {what}, got {value!r}")
  return value


def _tuple(types) -> tuple:
  return types if isinstance(types, tuple) else (types,)


def _sampling(body: dict, prompt_len: int, capacity: int, stop_token_ids: Sequence[int]
              ) -> SamplingParams:
  if _get(body, "n", int, 1) != 1:
    raise ApiError("only n=1 is supported")
  max_tokens = _get(body, "max_completion_tokens", int, None, lambda v: v >= 1, "an int >= 1")
  if max_tokens is None:
    max_tokens = _get(body, "max_tokens", int, None, lambda v: v >= 1, "an int >= 1")
  stop = body.get("stop")
  stop = [stop] if isinstance(stop, str) else (stop or [])
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise ApiError(f"'stop' must be a non-empty string or a list of them, got {stop!r}")
  seed = _get(body, "seed", int, None)
  try:
    return SamplingParams(
        # Without max_tokens a reply may fill the slot; the engine ends it at capacity ("length").
        max_new_tokens=max_tokens or max(1, capacity - prompt_len),
        temperature=float(_get(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2,
                               "a number in [0, 2]")),
        top_p=float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1,
                         "a number in (0, 1]")),
        top_k=_get(body, "top_k", int, 0, lambda v: v >= 0, "an int >= 0"),
        # Unseeded requests differ from each other, as OpenAI's do.
        seed=(seed if seed is not None else secrets.randbits(31)) % 2**32,
        stop_token_ids=tuple(stop_token_ids), stop=tuple(stop))
  except ValueError as e:
    raise ApiError(str(e)) from None


def _check_messages(messages: Any) -> None:
  if not isinstance(messages, list) or not messages:
    raise ApiError("'messages' must be a non-empty list of message objects")
  for i, message in enumerate(messages):
    if not isinstance(message, dict) or message.get("role") not in ROLES:
      raise ApiError(f"messages[{i}] must be an object with 'role' in {ROLES}")
    content = message.get("content")
    if not (content is None or isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str)
        for p in content))):
      raise ApiError(f"messages[{i}].content must be a string, null or a list of text parts")
    for j, call in enumerate(message.get("tool_calls") or []):
      function = call.get("function") if isinstance(call, dict) else None
      if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
          not isinstance(function.get("arguments"), (str, dict)):
        raise ApiError(f"messages[{i}].tool_calls[{j}] must have function.name and "
                       "function.arguments")


def prepare_chat(body: dict, tokenizer: Tokenizer, capacity: int) -> Prepared:
  messages = body.get("messages")
  _check_messages(messages)
  tools = _get(body, "tools", list, None, what="a list of tool objects")
  if tools is not None and not all(isinstance(t, dict) for t in tools):
    raise ApiError("'tools' must be a list of tool objects")
  # tool_choice is accepted and treated as "auto": the model decides (no constrained decoding).
  template = _get(body, "chat_template_kwargs", dict, {}, what="an object")
  thinking = bool(template.get("thinking", True))
  try:
    prompt = chat.render_generation_prompt(tokenizer, messages, tools, thinking=thinking)
  except (KeyError, TypeError, ValueError) as e:
    raise ApiError(f"cannot render the conversation: {e}") from None
  stop_ids = sorted({tokenizer.special_id(kimi_vocab.IM_END), tokenizer.eos_id})
  sampling = _sampling(body, len(prompt), capacity, stop_ids)
  options = _get(body, "stream_options", dict, {}, what="an object")
  return Prepared("chat", Request(prompt, sampling, id=f"chatcmpl-{uuid.uuid4().hex}"),
                  bool(_get(body, "stream", bool, False)), bool(options.get("include_usage")),
                  bool(_get(body, "logprobs", bool, False)), in_reasoning=thinking)


def prepare_completion(body: dict, tokenizer: Tokenizer, capacity: int) -> Prepared:
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # a batch of one
  if isinstance(prompt, str):
    prompt_ids = tokenizer.encode(prompt)
  elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in prompt):
    prompt_ids = list(prompt)
  else:
    raise ApiError("'prompt' must be a string or a list of token ids (one prompt per request)")
  if body.get("echo"):
    raise ApiError("'echo' is not supported")
  logprobs = _get(body, "logprobs", int, None, lambda v: 0 <= v <= 5, "an int in [0, 5]")
  sampling = _sampling(body, len(prompt_ids), capacity, [tokenizer.eos_id])
  options = _get(body, "stream_options", dict, {}, what="an object")
  return Prepared("text", Request(prompt_ids, sampling, id=f"cmpl-{uuid.uuid4().hex}"),
                  bool(_get(body, "stream", bool, False)), bool(options.get("include_usage")),
                  logprobs is not None)


def _visible(text: str, stops: Sequence[str], final: bool) -> str:
  """The part of `text` that can no longer change: cut at a stop string, minus the held back."""
  cut = min((text.find(s) for s in stops if s in text), default=-1)
  if cut >= 0:
    return text[:cut]
  if final:
    return text
  text = text.rstrip("\ufffd")
  hold = max((len(s) for s in stops), default=1) - 1
  return text[:len(text) - hold] if hold else text


class Reply:
  """Accumulates one request's tokens; renders the full response or the next stream delta."""

  def __init__(self, prepared: Prepared, tokenizer: Tokenizer, model_name: str):
    self.prepared, self.tokenizer, self.model_name = prepared, tokenizer, model_name
    self.created = int(time.time())
    self.token_ids: list[int] = []
    self.logprobs: list[float] = []
    self._sent = {"content": "", "reasoning": "", "text": ""}
    self._sent_calls: list[int] = []  # arguments characters sent, per call already announced
    self._sent_logprobs = 0

  # --------------------------------------------------------------------------------- parsing
  def _body_ids(self) -> list[int]:
    stops = self.prepared.request.sampling.stop_token_ids
    ids = self.token_ids
    return ids[:-1] if ids and ids[-1] in stops else ids

  def _parsed(self) -> tool_calls.ParsedReply:
    return tool_calls.parse_assistant_ids(self.tokenizer, self._body_ids(),
                                          in_reasoning=self.prepared.in_reasoning)

  def _fields(self, final: bool) -> tuple[dict, list[tool_calls.ToolCall]]:
    stops = self.prepared.request.sampling.stop
    if self.prepared.kind == "text":
      return {"text": _visible(self.tokenizer.decode(self._body_ids()), stops, final)}, []
    parsed = self._parsed()
    return ({"content": _visible(parsed.content, stops, final),
             "reasoning": _visible(parsed.reasoning, stops, final)}, parsed.tool_calls)

  def _finish_reason(self, result: Result, calls) -> str:
    if self.prepared.kind == "chat" and calls and result.finish_reason == "stop":
      return "tool_calls"
    return result.finish_reason

  def _usage(self) -> dict:
    prompt = len(self.prepared.request.prompt)
    return {"prompt_tokens": prompt, "completion_tokens": len(self.token_ids),
            "total_tokens": prompt + len(self.token_ids)}

  def _logprobs(self, start: int) -> Optional[dict]:
    if not self.prepared.logprobs:
      return None
    ids, values = self.token_ids[start:], self.logprobs[start:]
    tokens = [self.tokenizer.decode([t]) for t in ids]
    if self.prepared.kind == "chat":
      return {"content": [{"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": []}
                          for s, v in zip(tokens, values)]}
    offset = len(self.tokenizer.decode(self.token_ids[:start])) if start else 0
    offsets = []
    for s in tokens:
      offsets.append(offset)
      offset += len(s)
    # top_logprobs needs the engine to return alternatives; it returns the chosen token's only.
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None,
            "text_offset": offsets}

  def add(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
    self.token_ids += list(token_ids)
    self.logprobs += list(logprobs)

  # -------------------------------------------------------------------------------- responses
  def response(self, result: Result) -> dict:
    fields, calls = self._fields(final=True)
    reason = self._finish_reason(result, calls)
    if self.prepared.kind == "text":
      choice = {"index": 0, "text": fields["text"], "logprobs": self._logprobs(0),
                "finish_reason": reason}
      return {"id": self.prepared.request.id, "object": "text_completion",
              "created": self.created, "model": self.model_name, "choices": [choice],
              "usage": self._usage()}
    message = {"role": "assistant", "content": fields["content"] or (None if calls else ""),
               "reasoning_content": fields["reasoning"] or None,
               "tool_calls": [c.to_openai() for c in calls] or None}
    choice = {"index": 0, "message": message, "logprobs": self._logprobs(0),
              "finish_reason": reason}
    return {"id": self.prepared.request.id, "object": "chat.completion", "created": self.created,
            "model": self.model_name, "choices": [choice], "usage": self._usage()}

  def _chunk(self, choices: list, **extra) -> dict:
    kind = "chat.completion.chunk" if self.prepared.kind == "chat" else "text_completion"
    return {"id": self.prepared.request.id, "object": kind, "created": self.created,
            "model": self.model_name, "choices": choices, **extra}

  def first_chunks(self) -> list[dict]:
    if self.prepared.kind != "chat":
      return []
    return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])]

  def chunks(self, result: Optional[Result]) -> list[dict]:
    """Chunks carrying what became visible since the last call; the final ones when `result`."""
    fields, calls = self._fields(final=result is not None)
    delta: dict[str, Any] = {}
    for key, text in fields.items():
      if len(text) > len(self._sent[key]):
        delta["reasoning_content" if key == "reasoning" else key] = text[len(self._sent[key]):]
        self._sent[key] = text
    call_deltas = []
    for index, call in enumerate(calls):
      arguments = call.arguments if result is not None else call.arguments.rstrip("\ufffd")
      if index == len(self._sent_calls):
        self._sent_calls.append(0)
        call_deltas.append({"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
      if len(arguments) > self._sent_calls[index]:
        call_deltas.append({"index": index,
                            "function": {"arguments": arguments[self._sent_calls[index]:]}})
        self._sent_calls[index] = len(arguments)
    if call_deltas:
      delta["tool_calls"] = call_deltas
    logprobs = self._logprobs(self._sent_logprobs) if len(self.token_ids) > self._sent_logprobs \
        else None
    self._sent_logprobs = len(self.token_ids)
    reason = self._finish_reason(result, calls) if result is not None else None
    if not delta and logprobs is None and reason is None:
      return []
    if self.prepared.kind == "text":
      choice = {"index": 0, "text": delta.get("text", ""), "logprobs": logprobs,
                "finish_reason": reason}
    else:
      choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    out = [self._chunk([choice])]
    if result is not None and self.prepared.include_usage:
      out.append(self._chunk([], usage=self._usage()))
    return out
