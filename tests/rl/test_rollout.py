"""The token-in-token-out rollout driver without a model: the template's prefix stability it relies
on, then a scripted engine replaying the oracle's replies as ids, so every per-token array of the
segment can be checked against what each request was sent and answered (routes from the first
request that fed a position), plus cut replies, engine errors and the context limit."""
import dataclasses
import os
import re

import numpy as np
import pytest

from c2.data import chat, kimi_vocab
from c2.data.tokenizer import load_tokenizer
from c2.data.tool_calls import STRUCTURAL_TOKENS
from c2.envs.environment import CodingEnv
from c2.envs.policies import OraclePolicy
from c2.infer.engine import Result
from c2.model.router import NOT_RECORDED
from c2.rl.coordinator import rollout_seed
from c2.rl.rollout import RolloutError, RolloutSpec, environment_tokens, run_rollout

MOE_LAYERS, TOP_K = 2, 3  # the scripted engine's route record shape [n, Y, K]
UNRECORDED = np.array(NOT_RECORDED).astype(np.uint16)  # 65535: -1 as the uint16 record stores it
_STRUCTURAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in STRUCTURAL_TOKENS) + ")")


def reply_ids(tokenizer, text):
  """Template text -> the ids a model would sample: structural tokens by id, the text between
  them encoded run by run (as c2.data.chat.render_chat encodes it)."""
  ids = []
  for i, part in enumerate(_STRUCTURAL_SPLIT.split(text)):
    if i % 2:
      ids.append(tokenizer.special_id(part))
    elif part:
      ids += tokenizer.encode(part)
  return ids


@pytest.fixture(scope="module")
def world(rl_world):
  tokenizer = load_tokenizer(rl_world.tokenizer_path)
  # set_constant's oracle takes read_file, edit_file, finish: within the world's 3 turns.
  task = next(t for t in rl_world.tasks if t.kind == "set_constant")
  return rl_world, tokenizer, task


def oracle_texts(task, env_config):
  policy = OraclePolicy(task, as_text=True, thinking=env_config.thinking)
  return [policy([]) for _ in range(env_config.max_turns)]


class ScriptedEngine:
  """A `generate` that answers turn t with `replies[t]` (ids), cut at the request's
  max_new_tokens. Each answer carries recognisable values: log-prob -(t + 1) - i / 1000 for its
  i-th token, version 100 + t, and routes [fed, Y, K] with layer 0 = t + 1 (which request fed
  the position) and layer 1 = the position itself. It also records, when called, what the chat
  template renders for the environment's context at that moment."""

  def __init__(self, tokenizer, env, replies, *, cut=(), error_at=None):
    self.tokenizer, self.env, self.replies = tokenizer, env, replies
    self.cut, self.error_at = set(cut), error_at
    self.requests, self.results, self.rendered = [], [], []

  def __call__(self, request):
    t = len(self.requests)
    self.requests.append(request)
    self.rendered.append(chat.render_generation_prompt(
        self.tokenizer, self.env.messages, self.env.tool_schemas(),
        thinking=self.env.config.thinking))
    prompt = list(request.prompt)
    if t == self.error_at:
      result = Result(request.id, prompt, [], [], [], None, "error", error="scripted failure")
      self.results.append(result)
      return result
    ids, reason = list(self.replies[t]), "stop"
    if t in self.cut:  # as if max_new_tokens fell just before the closing <|im_end|>
      ids, reason = ids[:-1], "length"
    if len(ids) > request.sampling.max_new_tokens:
      ids, reason = ids[:request.sampling.max_new_tokens], "length"
    fed = len(prompt) + len(ids) - 1
    routes = np.zeros((fed, MOE_LAYERS, TOP_K), np.uint16)
    routes[:, 0] = t + 1
    routes[:, 1] = np.arange(fed)[:, None]
    logprobs = [-(t + 1) - i / 1000 for i in range(len(ids))]
    result = Result(request.id, prompt, ids, logprobs, [100 + t] * len(ids), routes, reason,
                    stop=ids[-1] if reason == "stop" else None)
    self.results.append(result)
    return result


def scripted_rollout(world, *, max_context=4096, seed=5, **engine_kwargs):
  rl_world, tokenizer, task = world
  env_config = rl_world.spec.env
  env = CodingEnv(task, env_config, count_tokens=lambda text: len(tokenizer.encode(text)))
  replies = [reply_ids(tokenizer, text) for text in oracle_texts(task, env_config)]
  engine = ScriptedEngine(tokenizer, env, replies, **engine_kwargs)
  sampling = dataclasses.replace(rl_world.spec.sampling, max_new_tokens=512)
  spec = RolloutSpec(group_id=3, index=1, task_id=task.task_id, seed=seed)
  return spec, env, engine, lambda: run_rollout(spec, env, engine, tokenizer, sampling,
                                                max_context=max_context)


def test_generation_prompt_grows_by_the_reply_then_exactly_the_environment_tokens(world):
  rl_world, tokenizer, task = world
  env_config = rl_world.spec.env
  thinking = env_config.thinking
  env = CodingEnv(task, env_config)
  env.reset()
  policy = OraclePolicy(task, as_text=True, thinking=thinking)
  prompt = chat.render_generation_prompt(tokenizer, env.messages, env.tool_schemas(),
                                         thinking=thinking)
  try:
    done, turns = False, 0
    while not done:
      text = policy(env.messages)
      ids = reply_ids(tokenizer, text)
      assert ids[-1] == tokenizer.special_id(kimi_vocab.IM_END)
      context = len(env.messages)
      _, done, _ = env.step(text)
      turns += 1
      # The context rendered through the reply (as the environment recorded it) is the previous
      # generation prompt followed by the reply's ids: the reply's header was in the prompt.
      reply_end = len(chat.render_chat(tokenizer, env.messages[:context + 1],
                                       env.tool_schemas()).token_ids)
      assert reply_end == len(prompt) + len(ids)
      after = chat.render_generation_prompt(tokenizer, env.messages, env.tool_schemas(),
                                            thinking=thinking)
      assert after[:reply_end] == prompt + ids
      suffix = environment_tokens(tokenizer, env, reply_end, thinking)
      assert after == prompt + ids + suffix
      if not done:  # the tool output and a fresh assistant header
        assert len(suffix) > 20
        assert suffix[0] == tokenizer.special_id(kimi_vocab.IM_SYSTEM)
        assert suffix[-1] == tokenizer.special_id(kimi_vocab.THINK_BEGIN)
      prompt = after
    assert turns == 3 and env.finish_reason == "finish"
  finally:
    env.close()


def test_scripted_oracle_rollout_keeps_every_token_where_it_was_sampled(world):
  _, tokenizer, _ = world
  spec, env, engine, run = scripted_rollout(world)
  rollout = run()

  assert rollout.passed and rollout.reward > 0 and rollout.finish_reason == "finish"
  assert rollout.reward_terms["reward/task"] == 1.0
  assert rollout.reward_terms["reward/total"] == rollout.reward
  assert len(rollout.segments) == 1 and len(engine.requests) == 3
  assert not os.path.exists(env.workspace.root)  # closed
  im_end = tokenizer.special_id(kimi_vocab.IM_END)
  for t, request in enumerate(engine.requests):
    # Each request is the whole context so far, exactly as the template renders it.
    assert list(request.prompt) == engine.rendered[t]
    assert request.id.startswith(f"g3-s1-t{t}-")  # + a per-attempt suffix (retries)
    assert request.sampling.seed == spec.seed * 1009 + t
    assert tuple(request.sampling.stop_token_ids) == (im_end,)
  seg = rollout.segments[0]
  last = engine.results[-1]
  assert seg.tokens == last.prompt_ids + last.token_ids

  n = len(seg.tokens)
  mask = np.zeros(n, bool)
  logp, versions = np.zeros(n), np.full(n, -1)
  first_feeder = np.full(n, -1)
  for t, result in enumerate(engine.results):
    start = len(result.prompt_ids)
    stop = start + len(result.token_ids)
    assert seg.tokens[start:stop] == result.token_ids
    mask[start:stop] = True
    logp[start:stop] = result.logprobs
    versions[start:stop] = 100 + t
    fed = stop - 1
    unset = first_feeder[:fed] < 0
    first_feeder[:fed][unset] = t
  assert seg.model_mask == mask.tolist()
  np.testing.assert_allclose(seg.sampler_logp, logp)
  assert seg.versions == versions.tolist()
  assert rollout.min_version == 100 and rollout.max_version == 102
  assert rollout.sampled_tokens == sum(len(r.token_ids) for r in engine.results)
  assert rollout.stats["sampled_tokens"] == rollout.sampled_tokens
  assert rollout.stats["turns"] == 3 and rollout.stats["truncated"] == 0

  assert seg.routes.dtype == np.uint16 and seg.routes.shape == (n, MOE_LAYERS, TOP_K)
  assert (first_feeder[:-1] >= 0).all() and first_feeder[-1] == -1  # the last token: never fed
  feeder = np.repeat(first_feeder[:-1, None] + 1, TOP_K, 1)  # layer 0: which request, plus 1
  np.testing.assert_array_equal(seg.routes[:-1, 0], feeder)
  np.testing.assert_array_equal(seg.routes[:-1, 1], np.repeat(np.arange(n - 1)[:, None], TOP_K, 1))
  assert (seg.routes[-1] == UNRECORDED).all()
  # Every turn's routes were used: turn 1 fed the first environment tokens of turn 0, etc.
  assert sorted(set(first_feeder[:-1].tolist())) == [0, 1, 2]


def test_per_turn_seeds_stay_in_the_engine_range_for_any_rollout_seed(world):
  # rollout_seed reaches 2**31 - 2 for data.seed > 0; the per-turn seed (seed * 1009 + turn) then
  # left uint32 and SamplingParams refused it (a data.seed=1 RL run died at its first rollout).
  top = rollout_seed(1, 4321, 3)
  assert top > 2**32 // 1009
  _, _, engine, run = scripted_rollout(world, seed=top)
  assert run().passed
  seeds = [r.sampling.seed for r in engine.requests]
  assert seeds == [(top * 1009 + t) % 2**32 for t in range(len(seeds))]
  assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**32 for s in seeds)


def test_a_reply_cut_by_max_new_tokens_is_closed_with_an_untrained_im_end(world):
  _, tokenizer, _ = world
  _, _, engine, run = scripted_rollout(world, cut=(0,))
  rollout = run()
  im_end = tokenizer.special_id(kimi_vocab.IM_END)
  first = engine.results[0]
  assert first.finish_reason == "length" and first.token_ids[-1] != im_end
  end = len(first.prompt_ids) + len(first.token_ids)
  seg = rollout.segments[0]
  assert seg.tokens[end] == im_end
  assert not seg.model_mask[end] and seg.sampler_logp[end] == 0 and seg.versions[end] == -1
  assert seg.model_mask[end - 1]
  # The closing id is the template's: the next request is still exactly the rendered context.
  assert list(engine.requests[1].prompt) == engine.rendered[1]
  assert list(engine.requests[1].prompt)[:end + 1] == first.prompt_ids + first.token_ids + [im_end]
  assert rollout.passed and len(engine.requests) == 3
  assert rollout.sampled_tokens == sum(len(r.token_ids) for r in engine.results)


def test_an_engine_error_raises_rollout_error_and_closes_the_environment(world):
  _, env, engine, run = scripted_rollout(world, error_at=1)
  with pytest.raises(RolloutError, match="engine error at turn 1.*scripted failure"):
    run()
  assert len(engine.requests) == 2
  assert not os.path.exists(env.workspace.root)


def test_the_context_limit_ends_the_rollout_as_truncated_within_the_limit(world):
  _, tokenizer, _ = world
  # Room for the first reply, not for the file contents read_file sends back.
  _, probe_env, probe, _ = scripted_rollout(world)
  probe_env.reset()
  prompt = chat.render_generation_prompt(tokenizer, probe_env.messages, probe_env.tool_schemas())
  probe_env.close()
  limit = len(prompt) + len(probe.replies[0]) + 5
  _, env, engine, run = scripted_rollout(world, max_context=limit)
  rollout = run()
  assert len(engine.requests) == 1
  assert rollout.finish_reason == "context_full" and rollout.stats["truncated"] == 1
  assert not rollout.passed
  seg = rollout.segments[0]
  # The trainer's rows hold max_context tokens: environment tokens past it are not kept.
  full = chat.render_generation_prompt(tokenizer, env.messages, env.tool_schemas())
  assert len(full) > limit + 20
  assert seg.tokens == full[:limit]
  assert seg.tokens[:limit - 5] == prompt + probe.replies[0]
  assert sum(seg.model_mask) == len(probe.replies[0])
  assert len(seg.sampler_logp) == len(seg.versions) == seg.routes.shape[0] == limit

  # A limit inside the first reply: the engine is asked for no more than the room, the reply is
  # cut there, and the segment still fits (the closing <|im_end|> would be token limit + 1).
  limit = len(prompt) + 10
  _, _, engine, run = scripted_rollout(world, max_context=limit)
  rollout = run()
  assert engine.requests[0].sampling.max_new_tokens == 10
  assert len(engine.results[0].token_ids) == 10
  assert len(rollout.segments[0].tokens) <= limit
  assert sum(rollout.segments[0].model_mask) == 10
