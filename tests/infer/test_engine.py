"""The engine against plain references: full-forward greedy decoding, the trainer's forward with
replayed routes, a fresh decode after a weight swap, a single-device run of the sharded engine.

All in float32 on the small test model (one dense + one MoE layer, one MTP module).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2 import model
from c2.infer import Engine, Request, SamplingParams, forced_routes
from c2.infer import cache as cache_lib
from c2.infer import steps
from c2.parallel.mesh import make_mesh

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def params(small_cfg):
  return model.init_params(small_cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts(small_cfg):
  rng = np.random.RandomState(0)
  return [rng.randint(2, small_cfg.vocab_size, size=n).tolist() for n in (5, 23, 12, 40, 3)]


REFERENCE_LEN = 64  # the reference pads every row to this length: one compile, causal anyway


@functools.lru_cache(maxsize=None)
def _padded_logits(cfg):
  return jax.jit(lambda params, tokens: model.logits(cfg, params, tokens))


def full_forward_greedy(cfg, params, prompt, n):
  """Greedy decoding by re-running the training forward over the whole row for every token."""
  tokens = list(prompt)
  for _ in range(n):
    row = np.zeros((1, REFERENCE_LEN), np.int32)
    row[0, :len(tokens)] = tokens
    logits = _padded_logits(cfg)(params, row)
    tokens.append(int(jnp.argmax(logits[0, len(tokens) - 1])))
  return tokens[len(prompt):]


@pytest.fixture(scope="module")
def reference(small_cfg, params, prompts):
  return [full_forward_greedy(small_cfg, params, p, GREEDY.max_new_tokens) for p in prompts]


@pytest.mark.parametrize("draft_depth", [0, 1, pytest.param(2, marks=pytest.mark.slow)])
def test_greedy_equals_full_forward_greedy(small_cfg, params, prompts, reference, draft_depth):
  # 2 slots for 5 requests: slots are refilled while the other sequence is in flight; prompts of
  # up to 40 tokens go in chunks of 8, two prefill rows per step (one is often padding that
  # names slot 0 while a real row refills slot 0: padding must not write).
  engine = Engine(small_cfg, params, slots=2, capacity=64, prefill_chunk=8, prefill_rows=2,
                  draft_depth=draft_depth)
  results = engine.generate([Request(p, GREEDY) for p in prompts])
  assert [r.token_ids for r in results] == reference
  assert all(r.finish_reason == "length" for r in results)
  for r, p in zip(results, prompts):
    assert r.routes.dtype == np.uint16
    assert r.routes.shape == (len(p) + 10 - 1, small_cfg.num_moe_layers,
                              small_cfg.experts_per_token)


def test_replayed_routes_reproduce_sampler_logprobs(small_cfg, params, prompts):
  engine = Engine(small_cfg, params, slots=2, capacity=64, prefill_chunk=8, draft_depth=1)
  requests = [Request(p, SamplingParams(max_new_tokens=12, temperature=1.0, seed=i))
              for i, p in enumerate(prompts[:3])]
  for result in engine.generate(requests):
    tokens = jnp.array([result.prompt_ids + result.token_ids])
    out = model.forward(small_cfg, params, tokens, forced_routes=jnp.asarray(forced_routes(result)),
                        with_mtp=False)
    logits = out["hidden"][0] @ model.head_kernel(small_cfg, params)
    logp = jax.nn.log_softmax(logits, -1)
    p = len(result.prompt_ids)
    replayed = logp[jnp.arange(p - 1, tokens.shape[1] - 1), tokens[0, p:]]
    np.testing.assert_allclose(replayed, result.logprobs, atol=1e-5, rtol=0)
    # The trainer's own routing agrees with the record here (float32, same params).
    own = np.asarray(out["aux"]["moe"]["routes"][:, 0, :-1]).transpose(1, 0, 2)
    np.testing.assert_array_equal(np.sort(own, -1), np.sort(result.routes.astype(np.int32), -1))


def test_weight_swap_mid_generation(small_cfg, params, prompts):
  new_params = model.init_params(small_cfg, jax.random.key(7))
  engine = Engine(small_cfg, params, slots=2, capacity=64, prefill_chunk=8)
  prompt, swap_after = prompts[1], None
  request = Request(prompt, SamplingParams(max_new_tokens=10, temperature=0.0))
  for event in engine.stream(request):
    if event.result is not None:
      result = event.result
    elif swap_after is None and len(engine._active[0].tokens) >= 2:  # pylint: disable=protected-access
      # Taken before the next call: after the prefill's token and one call's decode_steps.
      swap_after = len(engine._active[0].tokens)  # pylint: disable=protected-access
      engine.update_weights(new_params, version=1)
  assert swap_after == 1 + engine.decode_steps
  assert result.versions == [0] * swap_after + [1] * (10 - swap_after)
  # Reference: the cache the old weights build over prompt + first tokens, then the new weights.
  cfg = small_cfg
  before = prompt + result.token_ids[:swap_after - 1]
  cache = cache_lib.allocate(cfg, 1, 64, dtype=jnp.float32)
  sampling = {"temperature": np.zeros(1, np.float32), "top_k": np.zeros(1, np.int32),
              "top_p": np.ones(1, np.float32), "seed": np.zeros(1, np.uint32)}
  prefill = jax.jit(functools.partial(steps.prefill, cfg=cfg, draft_depth=0))
  decode = jax.jit(functools.partial(steps.decode, cfg=cfg))
  cache, *_ = prefill(params, cache, jnp.array([before]), jnp.array([0]), jnp.array([0]),
                    jnp.array([len(before)]), jnp.array([0]), jnp.array([True]), sampling)
  token, after = result.token_ids[swap_after - 1], []
  for _ in range(10 - swap_after):
    cache, next_token, _, _ = decode(new_params, cache, jnp.array([token]), jnp.array([True]),
                                     sampling)
    token = int(next_token[0])
    after.append(token)
  assert result.token_ids[swap_after:] == after
  assert after != full_forward_greedy(cfg, params, prompt, 10)[swap_after:]  # the swap mattered


@pytest.mark.parametrize("draft_depth", [0, 1])
def test_prefix_reuse_equals_a_fresh_prefill(small_cfg, params, prompts, draft_depth):
  """A multi-turn rollout's next prompt extends the last one: the slot that served it prefills
  only the new tokens, with the tokens, log-probs and routes of a fresh prefill."""
  engine = Engine(small_cfg, params, slots=2, capacity=64, prefill_chunk=8,
                  draft_depth=draft_depth, prefix_cache=True)
  greedy = lambda n: SamplingParams(max_new_tokens=n, temperature=0.0)
  first = engine.generate([Request(prompts[1], greedy(6))])[0]
  engine.generate([Request(prompts[3], greedy(3))])  # unrelated: takes the other, empty slot
  turn = prompts[1] + first.token_ids + prompts[0]  # completion, then a tool's output
  before = engine.stats["prefix_reused_tokens"]
  second = engine.generate([Request(turn, greedy(8))])[0]
  cached = len(prompts[1]) + 6 - 1  # the last sampled token was never fed
  expected = cached - draft_depth - 1 if draft_depth else cached
  assert engine.stats["prefix_reused_tokens"] - before == expected

  fresh = Engine(small_cfg, params, slots=2, capacity=64, prefill_chunk=8,
                 draft_depth=draft_depth).generate([Request(turn, greedy(8))])[0]
  assert second.token_ids == fresh.token_ids
  np.testing.assert_allclose(second.logprobs, fresh.logprobs, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.sort(second.routes, -1), np.sort(fresh.routes, -1))

  engine.update_weights(params, version=1)  # entries of older weights are forgotten
  before = engine.stats["prefix_reused_tokens"]
  engine.generate([Request(turn + second.token_ids, greedy(2))])
  assert engine.stats["prefix_reused_tokens"] == before


@pytest.mark.slow  # ~80 s on 2 cores: three more engine compilations over the 8-device mesh
def test_sharded_engine_equals_single_device(small_cfg, params, prompts):
  requests = [Request(p, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3 + i))
              for i, p in enumerate(prompts[:4])]
  single = Engine(small_cfg, params, slots=4, capacity=64, prefill_chunk=8, draft_depth=1)
  mesh = make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
  sharded = Engine(small_cfg, params, slots=4, capacity=64, prefill_chunk=8, draft_depth=1,
                   mesh=mesh)
  # Unrolled layers (the engine's default): one cache array per MoE layer, each over all 8 devices.
  assert all(len(layer.sharding.device_set) == 8 for layer in sharded.cache.stacks["moe"])
  for a, b in zip(single.generate(requests), sharded.generate(requests)):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(a.routes, b.routes)


def test_bad_requests_fail_alone(small_cfg, params, prompts):
  engine = Engine(small_cfg, params, slots=2, capacity=32, prefill_chunk=8)
  results = engine.generate([
      Request(list(range(2, 40)), GREEDY),  # longer than a slot
      Request([], GREEDY),
      Request([5, small_cfg.vocab_size], GREEDY),
      Request(prompts[0], SamplingParams(max_new_tokens=30, temperature=0.0)),
  ])
  assert [r.finish_reason for r in results] == ["error", "error", "error", "length"]
  assert "38 tokens" in results[0].error and "capacity" in results[0].error
  assert "[0, 512)" in results[2].error
  # The good request ran into the end of its slot: 32 - 5 prompt tokens = 27 tokens in all.
  assert len(results[3].token_ids) == 32 - len(prompts[0])


def test_stop_tokens_and_max_tokens(small_cfg, params, prompts, reference):
  stop = reference[3][4]
  engine = Engine(small_cfg, params, slots=2, capacity=64, prefill_chunk=8, draft_depth=1)
  [result] = engine.generate([Request(prompts[3], SamplingParams(
      max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,)))])
  first = reference[3].index(stop)
  assert result.token_ids == reference[3][:first + 1]
  assert result.finish_reason == "stop" and result.stop == stop
  assert result.routes.shape[0] == len(prompts[3]) + first


@pytest.mark.parametrize("draft_depth", [0, 1])
def test_decode_steps_per_call_change_nothing_but_speed(small_cfg, params, prompts, draft_depth):
  """Several decode steps per device call (Engine(decode_steps=)) give what one step per call
  gives: tokens, log-probs, versions and routes, over slot reuse, stop tokens met mid-call,
  max_new_tokens not a multiple of the steps, and the end of a slot's capacity; the acceptance
  statistics count only steps whose tokens were kept."""
  requests = lambda: [
      Request(p, SamplingParams(max_new_tokens=n, temperature=1.0, seed=i,
                                stop_token_ids=tuple(range(2, 40)) if i % 2 == 0 else ()))
      for i, (p, n) in enumerate(zip(prompts * 2, (9, 3, 13, 40, 6, 1, 8, 5, 30, 2)))]
  runs = []
  for decode_steps in (1, 3):
    engine = Engine(small_cfg, params, slots=3, capacity=48, prefill_chunk=8,
                    draft_depth=draft_depth, decode_steps=decode_steps)
    runs.append((engine.generate(requests()), engine.stats))
  (one, one_stats), (three, three_stats) = runs
  assert [r.finish_reason for r in one].count("stop") >= 2  # stops were really met
  assert any(r.finish_reason == "length" and len(r.prompt_ids) + len(r.token_ids) == 48
             for r in one)  # and the end of a slot
  for a, b in zip(one, three):
    assert (a.token_ids, a.versions, a.finish_reason) == (b.token_ids, b.versions,
                                                          b.finish_reason)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(a.routes, b.routes)
    assert a.routes.shape[0] == len(a.prompt_ids) + len(a.token_ids) - 1
  assert one_stats["tokens"] == three_stats["tokens"]
  if draft_depth:
    assert one_stats["decode_rows"] == three_stats["decode_rows"]
    assert one_stats["accepted_depth_1"] == three_stats["accepted_depth_1"] > 0


@pytest.mark.slow  # ~75 s: the Pallas NVFP4 kernel runs interpreted on CPU
def test_low_precision_experts_match_the_trainer(small_cfg, params, prompts):
  """gmm_fmt reaches the sampler's expert matmuls exactly as the trainer's: NVFP4 experts (Pallas
  kernel, interpreted on CPU) give the trainer's log-probs under replay, and differ from bf16."""
  cfg = small_cfg.replace(gmm_impl="pallas", gmm_fmt="nvfp4")
  engine = Engine(cfg, params, slots=1, capacity=32, prefill_chunk=16)
  [result] = engine.generate([Request(prompts[1][:12], SamplingParams(
      max_new_tokens=4, temperature=1.0, seed=1))])
  tokens = jnp.array([result.prompt_ids + result.token_ids])
  forced = jnp.asarray(forced_routes(result))
  trainer = lambda c: jax.nn.log_softmax(model.forward(
      c, params, tokens, forced_routes=forced, with_mtp=False)["hidden"][0] @ model.head_kernel(
          c, params), -1)[jnp.arange(11, 15), tokens[0, 12:]]
  np.testing.assert_allclose(trainer(cfg), result.logprobs, atol=1e-5, rtol=0)
  assert np.abs(np.asarray(trainer(small_cfg)) - result.logprobs).max() > 1e-3


def test_closing_the_worker_ends_every_request_with_an_error(small_cfg, params, prompts):
  """No caller waits forever on a closed worker: requests in flight, queued, or submitted after
  the close all get an error result (a rollout thread blocked otherwise kept a process alive)."""
  from c2.infer.server import EngineWorker  # pylint: disable=import-outside-toplevel
  engine = Engine(small_cfg, params, slots=1, capacity=4096, prefill_chunk=8)
  worker = EngineWorker(engine)
  long = SamplingParams(max_new_tokens=4000, temperature=0.0)
  running = worker.submit(Request(prompts[0], long, id="running"))
  assert running.get(timeout=120).result is None  # a first token: it is in the engine
  queued = worker.submit(Request(prompts[1], long, id="queued"))  # no free slot
  worker.close()
  late = worker.submit(Request(prompts[2], long, id="late"))
  for outbox, request_id in ((running, "running"), (queued, "queued"), (late, "late")):
    event = outbox.get(timeout=30)
    while event.result is None:  # tokens streamed before the close
      event = outbox.get(timeout=30)
    assert event.result.finish_reason == "error" and event.request_id == request_id
    assert "closed" in event.result.error
