"""One agentic rollout, token in and token out: the engine samples, the environment acts, and the
trainer later sees exactly the ids that were sampled, with their log-probs, versions and routes.

    rollout = run_rollout(spec, env, generate, tokenizer, sampling)
    rollout.sequences   # per context segment: ids, model-token mask, sampler log-probs, routes

Why not re-render the finished conversation for training: a reply's text, tokenised again, need
not give back the ids the policy sampled (a BPE merge across a boundary, a malformed call the
parser repaired), and the loss must be computed on the sampled ids for the importance ratio and
router replay to mean anything. So the driver keeps each segment's ids itself: the generation
prompt, then every sampled completion verbatim, then the environment's reply as the chat template
renders it (the tokens the template adds after the reply's `<|im_end|>`; the rendering is
prefix-stable, checked by tests/rl/test_rollout.py). Every turn's request is the whole segment so
far, so the engine's route record of that request covers it; a position's routes are taken from
the first request that fed it (the one that sampled the next token).

A segment ends at a self-summary restart (the environment starts a new context) or at the end.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Callable, Optional

import numpy as np

from c2.data import chat, kimi_vocab
from c2.data import tool_calls as tool_call_parser
from c2.data.tokenizer import Tokenizer
from c2.envs.environment import CodingEnv
from c2.infer.engine import Request, Result
from c2.infer.sampling import SamplingParams
from c2.model.router import NOT_RECORDED


class RolloutError(RuntimeError):
  """The engine failed a request of this rollout (e.g. its worker died): retry or drop it."""


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """What to roll out: sample `index` of group `group_id` on `task_id` (seeded by both)."""
  group_id: int
  index: int
  task_id: str
  seed: int


@dataclasses.dataclass
class Segment:
  """One context of a rollout, as the engine saw it. Arrays are indexed by token."""
  tokens: list[int]
  model_mask: list[bool]  # True on sampled tokens
  sampler_logp: list[float]  # 0 on environment tokens
  versions: list[int]  # policy version per sampled token (-1 on environment tokens)
  routes: Optional[np.ndarray]  # uint16 [n, Y, K] (NOT_RECORDED where nothing fed the token)


@dataclasses.dataclass
class Rollout:
  spec: RolloutSpec
  segments: list[Segment]
  reward: float  # total (task + length + behaviour terms)
  reward_terms: dict  # RewardBreakdown.metrics(): reward/total, reward/task, reward/penalty/...
  passed: bool  # the task's hidden tests all pass
  finish_reason: str
  stats: dict  # turns, tool_calls, malformed calls, thinking/sampled tokens, summaries, seconds

  @property
  def min_version(self) -> int:
    versions = [v for s in self.segments for v in s.versions if v >= 0]
    return min(versions) if versions else -1

  @property
  def max_version(self) -> int:
    versions = [v for s in self.segments for v in s.versions if v >= 0]
    return max(versions) if versions else -1

  @property
  def sampled_tokens(self) -> int:
    return sum(sum(s.model_mask) for s in self.segments)


Generate = Callable[[Request], Result]  # blocking: one request in, its result out


class _SegmentBuilder:
  def __init__(self, prompt: list[int]):
    self.tokens = list(prompt)
    self.mask = [False] * len(prompt)
    self.logp = [0.0] * len(prompt)
    self.versions = [-1] * len(prompt)
    self.route_blocks: list[np.ndarray] = []  # routes of positions [0, covered)
    self.covered = 0

  def add_completion(self, result: Result) -> None:
    self.tokens += result.token_ids
    self.mask += [True] * len(result.token_ids)
    self.logp += [float(v) for v in result.logprobs]
    self.versions += [int(v) for v in result.versions]
    routes = result.routes
    if routes is not None and len(routes) > self.covered:
      self.route_blocks.append(np.asarray(routes[self.covered:]))
      self.covered = len(routes)

  def add_environment(self, ids: list[int]) -> None:
    self.tokens += ids
    self.mask += [False] * len(ids)
    self.logp += [0.0] * len(ids)
    self.versions += [-1] * len(ids)

  def build(self, max_len: int) -> Segment:
    """Drops the tokens past `max_len`: the trainer's rows hold max_context tokens (the packer
    refuses longer sequences), and only untrained ids can lie there (the environment's reply that
    filled the context, or the <|im_end|> closing a reply cut at the limit)."""
    n = min(len(self.tokens), max_len)
    routes = None
    if self.route_blocks:
      recorded = np.concatenate(self.route_blocks)[:n]
      routes = np.full((n,) + recorded.shape[1:], NOT_RECORDED, np.int32)
      routes[:len(recorded)] = recorded
      routes = routes.astype(np.uint16)  # NOT_RECORDED (-1) becomes 65535, as the engine stores
    return Segment(self.tokens[:n], self.mask[:n], self.logp[:n], self.versions[:n], routes)


def environment_tokens(tokenizer: Tokenizer, env: CodingEnv, reply_end: int,
                       thinking: bool) -> list[int]:
  """The ids the template puts after the last reply: its tool results and the next generation
  prompt (`reply_end` = length of the context rendered through that reply)."""
  prompt = chat.render_generation_prompt(tokenizer, env.messages, env.tool_schemas(),
                                         thinking=thinking)
  return prompt[reply_end:]


def run_rollout(spec: RolloutSpec, env: CodingEnv, generate: Generate, tokenizer: Tokenizer,
                sampling: SamplingParams, *, max_context: int) -> Rollout:
  """Drives `env` with the engine to the end, grades it, closes it. Raises RolloutError when the
  engine fails a request (the caller retries the rollout on a fresh environment or drops it)."""
  started = time.perf_counter()
  thinking = env.config.thinking
  im_end = tokenizer.special_id(kimi_vocab.IM_END)
  env.reset()
  segments: list[Segment] = []
  builder = _SegmentBuilder(chat.render_generation_prompt(tokenizer, env.messages,
                                                          env.tool_schemas(), thinking=thinking))
  turn, done, truncated = 0, False, False
  try:
    while not done:
      room = max_context - len(builder.tokens)
      if room < 2:
        truncated = True
        break
      # Modulo 2**32 (the engine's seed range): rollout seeds reach 2**31, so * 1009 overflowed
      # for every data.seed but 0 (it crashed the first rollout of a data.seed=1 run).
      turn_seed = (spec.seed * 1009 + turn) % 2**32
      request = Request(list(builder.tokens), dataclasses.replace(
          sampling, seed=turn_seed, max_new_tokens=min(sampling.max_new_tokens, room),
          stop_token_ids=(im_end,)),
          # Unique per attempt: a retried rollout must not share ids with its dead predecessor's
          # requests, which may still be running in the engine.
          id=f"g{spec.group_id}-s{spec.index}-t{turn}-{uuid.uuid4().hex[:8]}")
      result = generate(request)
      if result.finish_reason == "error":
        raise RolloutError(f"rollout {spec}: engine error at turn {turn}: {result.error}")
      builder.add_completion(result)
      if not result.token_ids or result.token_ids[-1] != im_end:
        builder.add_environment([im_end])  # a reply cut by max_new_tokens: close it, untrained
      reply = tool_call_parser.parse_assistant_ids(tokenizer, result.token_ids,
                                                   in_reasoning=thinking)
      reply_end = len(chat.render_chat(tokenizer, env.messages + [_as_message(reply)],
                                       env.tool_schemas()).token_ids)
      _, done, info = env.step(reply)
      turn += 1
      if info.get("new_segment"):
        segments.append(builder.build(max_context))
        builder = _SegmentBuilder(chat.render_generation_prompt(
            tokenizer, env.messages, env.tool_schemas(), thinking=thinking))
      elif not done:
        builder.add_environment(environment_tokens(tokenizer, env, reply_end, thinking))
    segments.append(builder.build(max_context))
    breakdown = env.reward()
    grade = env.grade_result
    passed = bool(grade is not None and grade.reward >= 1.0)
    stats = dict(env.counts)
    stats.update(seconds=time.perf_counter() - started, truncated=int(truncated),
                 sampled_tokens=sum(sum(s.model_mask) for s in segments),
                 context_tokens=max(len(s.tokens) for s in segments))
    return Rollout(spec, segments, float(breakdown.total), breakdown.metrics(), passed,
                   env.finish_reason or ("context_full" if truncated else "stopped"), stats)
  finally:
    env.close()


def _as_message(reply: tool_call_parser.ParsedReply) -> dict:
  """The assistant message the environment will record for `reply` (for the rendered length)."""
  return {"role": "assistant", "content": reply.content,
          "reasoning_content": reply.reasoning, "tool_calls": reply.openai_tool_calls()}
