"""The OpenAI-compatible server end to end: `python -m c2.serve` in a subprocess on a tiny random
checkpoint, driven by the official `openai` client and by raw HTTP for malformed requests.

A random model never emits tool calls by itself, so the tool-call mapping is checked twice
without it: a conversation holding assistant tool calls and tool results goes through the prompt
renderer (its token count must match a local render), and streamed tool-call deltas are checked
by feeding a rendered reply through the formatter in-process.
"""
import http.client
import json
import os
import queue
import shutil
import subprocess
import sys
import threading

import jax
import numpy as np
import openai
import orbax.checkpoint as ocp
import pytest

from c2 import model
from c2.data import chat, kimi_vocab
from c2.data.tokenizer import HuggingFaceTokenizer
from c2.hf import config as hf_config
from c2.infer import openai_api
from c2.infer.engine import Result
from c2.model.config import get_preset

SMALL = dict(dtype="float32", num_layers=2, hidden_size=64, dense_ffn_size=128, moe_ffn_size=32,
             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, vocab_size=512, remat_policy="none")
CAPACITY = 512
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
AGENT_MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "content": "18 C, sunny"},
]


def random_params(cfg, seed):
  """Params drawn with numpy (norm scales 1, router biases 0): no init compile on a busy CPU."""
  rng = np.random.default_rng(seed)

  def leaf(path, spec):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return np.ones(spec.shape, spec.dtype)
    if "correction_bias" in name:
      return np.zeros(spec.shape, spec.dtype)
    return (0.1 * rng.standard_normal(spec.shape)).astype(spec.dtype)

  return jax.tree_util.tree_map_with_path(leaf, model.abstract_params(cfg))


def save_converted_checkpoint(directory, tokenizer_path, seed=0):
  """The `python -m c2.hf.convert import` layout: params/ (orbax) + model_config.json."""
  cfg = get_preset("tiny", **SMALL)
  params = random_params(cfg, seed)
  os.makedirs(directory, exist_ok=True)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(os.path.abspath(directory), "params"), params)
  with open(os.path.join(directory, "model_config.json"), "w") as f:
    f.write(hf_config.to_json(cfg))
  shutil.copy(tokenizer_path, os.path.join(directory, "tokenizer.json"))
  return cfg, params


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_512):
  directory = str(tmp_path_factory.mktemp("serve") / "tiny-random")
  cfg, params = save_converted_checkpoint(directory, tokenizer_512)
  return directory, cfg, params, HuggingFaceTokenizer.from_file(tokenizer_512)


@pytest.fixture(scope="module")
def server(checkpoint):
  """(base_url, process): one server for the module, always terminated."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one host device is enough
  process = subprocess.Popen(
      [sys.executable, "-m", "c2.serve", "--checkpoint", checkpoint[0], "--port", "0",
       "--slots", "2", "--capacity", str(CAPACITY), "--prefill-chunk", "32"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  lines: queue.Queue = queue.Queue()
  threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
  output = []
  try:
    while True:
      try:
        line = lines.get(timeout=120)
      except queue.Empty:
        pytest.fail("server not ready after 120 s:\n" + "".join(output))
      output.append(line)
      if "ready on http://" in line:
        yield line.split("ready on ")[1].strip(), process
        break
      if process.poll() is not None and lines.empty():
        pytest.fail("server exited before ready:\n" + "".join(output))
  finally:
    process.terminate()
    try:
      process.wait(timeout=20)
    except subprocess.TimeoutExpired:
      process.kill()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def raw(server, method, path, body=None, headers=None):
  """(status, decoded JSON) for a raw request; body: dict (as JSON), bytes or None."""
  host, port = server[0].removeprefix("http://").split(":")
  connection = http.client.HTTPConnection(host, int(port), timeout=60)
  data = json.dumps(body).encode() if isinstance(body, dict) else body
  connection.request(method, path, body=data, headers=headers or {})
  response = connection.getresponse()
  status, payload = response.status, json.loads(response.read())
  connection.close()
  return status, payload


def test_models(client, checkpoint):
  assert [m.id for m in client.models.list().data] == ["tiny-random"]


def test_chat_with_tool_history(client, checkpoint):
  tokenizer = checkpoint[3]
  response = client.chat.completions.create(
      model="tiny-random", messages=AGENT_MESSAGES, tools=TOOLS, tool_choice="auto",
      max_tokens=6, temperature=0, seed=1)
  choice = response.choices[0]
  assert choice.message.role == "assistant"
  assert choice.finish_reason in ("stop", "length", "tool_calls")
  # The server rendered tool calls and results exactly as the SFT renderer does.
  prompt = chat.render_generation_prompt(tokenizer, AGENT_MESSAGES, TOOLS)
  assert response.usage.prompt_tokens == len(prompt)
  assert 1 <= response.usage.completion_tokens <= 6


def test_chat_stream_matches_non_stream(client):
  kwargs = dict(model="tiny-random", messages=[{"role": "user", "content": "Hello"}],
                tools=TOOLS, max_tokens=8, temperature=0, seed=3)
  whole = client.chat.completions.create(**kwargs).choices[0]
  chunks = list(client.chat.completions.create(
      **kwargs, stream=True, stream_options={"include_usage": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
  deltas = [c.choices[0].delta for c in chunks if c.choices]
  content = "".join(d.content or "" for d in deltas)
  reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
  assert content == (whole.message.content or "")
  assert reasoning == (getattr(whole.message, "reasoning_content", None) or "")
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason


def test_completion_token_ids_logprobs_match_model(client, checkpoint):
  _, cfg, params, _ = checkpoint
  prompt = [5, 17, 42, 99, 300]
  response = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=5,
                                       temperature=0, logprobs=1)
  choice = response.choices[0]
  assert response.usage.prompt_tokens == len(prompt)
  n = response.usage.completion_tokens
  assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == n
  # Greedy tokens are the model's argmax and report its own log-probs: replay greedy decoding
  # in-process (one fixed padded shape, one compile; the model is causal, so padding is inert).
  tokens, expected = list(prompt), []
  forward = jax.jit(lambda t: model.logits(cfg, params, t))
  for _ in range(n):
    padded = np.zeros((1, 16), np.int32)
    padded[0, :len(tokens)] = tokens
    logprobs = jax.nn.log_softmax(np.asarray(forward(padded)[0, len(tokens) - 1], np.float32))
    tokens.append(int(np.argmax(logprobs)))
    expected.append(float(logprobs[tokens[-1]]))
  tokenizer = checkpoint[3]
  assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in tokens[len(prompt):]]
  np.testing.assert_allclose(choice.logprobs.token_logprobs, expected, atol=2e-4)


def test_completion_stream_text_prompt(client):
  kwargs = dict(model="tiny-random", prompt="def main():", max_tokens=6, temperature=0)
  whole = client.completions.create(**kwargs).choices[0]
  streamed = list(client.completions.create(**kwargs, stream=True))
  assert "".join(c.choices[0].text for c in streamed) == whole.text
  assert streamed[-1].choices[0].finish_reason == whole.finish_reason


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/chat/completions", {"model": "m"}, 400),  # no messages
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400),
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400),
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/completions", {"prompt": list(range(1, CAPACITY + 10))}, 400),  # too long
    ("POST", "/v1/completions", {"prompt": [1, 10**6]}, 400),  # outside the vocabulary
    ("POST", "/v1/completions", {"prompt": {"a": 1}}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("POST", "/v1/embeddings", {"input": "x"}, 404),
    ("GET", "/v1/nothing", None, 404),
])
def test_bad_requests_get_4xx_and_server_survives(server, client, method, path, body, status):
  got, payload = raw(server, method, path, body, {"Content-Type": "application/json"})
  assert got == status, payload
  assert payload["error"]["message"] and payload["error"]["type"]
  assert server[1].poll() is None
  assert client.models.list().data


def test_prompt_too_long_names_the_limit(server):
  status, payload = raw(server, "POST", "/v1/completions", {"prompt": [1] * (CAPACITY + 1)})
  assert status == 400 and str(CAPACITY) in payload["error"]["message"]


def test_streamed_tool_call_deltas(checkpoint):
  """A rendered tool-call reply fed token by token through the stream formatter reassembles into
  the OpenAI tool calls, and the non-streamed response agrees."""
  tokenizer = checkpoint[3]
  reply_message = {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}
  ids = chat.render_chat(tokenizer, [AGENT_MESSAGES[0], reply_message]).token_ids
  im_middle = tokenizer.special_id(kimi_vocab.IM_MIDDLE)
  body = ids[len(ids) - ids[::-1].index(im_middle):]  # after the last header, with <think></think>
  prepared = openai_api.prepare_chat({"messages": AGENT_MESSAGES[:1], "tools": TOOLS},
                                     tokenizer, CAPACITY)
  prepared.in_reasoning = False  # the rendered reply opens its own <think>
  formatter = openai_api.Reply(prepared, tokenizer, "m")
  deltas = []
  for i, token in enumerate(body):
    formatter.add([token], [0.0])
    done = Result("r", [], body, [0.0] * len(body), [], None, "stop") if i == len(body) - 1 \
        else None
    deltas += [c["choices"][0]["delta"] for c in formatter.chunks(done)]
  calls = {}
  for delta in deltas:
    for part in delta.get("tool_calls", []):
      call = calls.setdefault(part["index"], {"id": None, "type": "function",
                                              "function": {"name": None, "arguments": ""}})
      call["id"] = part.get("id", call["id"])
      call["function"]["name"] = part.get("function", {}).get("name", call["function"]["name"])
      call["function"]["arguments"] += part.get("function", {}).get("arguments", "")
  assert list(calls.values()) == [CALL]
  assert "".join(d.get("content", "") for d in deltas) == "Checking."
  final = formatter.response(Result("r", [], body, [], [], None, "stop"))
  assert final["choices"][0]["finish_reason"] == "tool_calls"
  assert final["choices"][0]["message"]["tool_calls"] == [CALL]
