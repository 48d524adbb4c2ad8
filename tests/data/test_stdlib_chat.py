"""The embedded SFT corpus: valid coding-task chats, deterministic, on the corpus's split, and
loss masks that cover assistant tokens only."""
import ast
import hashlib
import json
import pickle
import re

import numpy as np
import pytest

from c2.data import chat, kimi_vocab, pipeline, sources, stdlib_chat, stdlib_corpus
from c2.data.examples import ConversationToExample

CODE_BLOCK = re.compile(r"\A```python\n(.*)\n```\Z", re.DOTALL)
TASK = re.compile(r"\AImplement `(\w+)\(.*?\)(?: -> .*?)?` in the Python standard library "
                  r"module `([\w.]+)`", re.DOTALL)


def _digest(records) -> str:
  return hashlib.sha256("\n".join(records).encode()).hexdigest()


@pytest.mark.parametrize("split", stdlib_corpus.SPLITS)
def test_records_are_valid_tasks_from_their_split(split):
  records = stdlib_chat.chat_records(split)
  assert len(records) >= (1000 if split == "train" else 10)
  root = stdlib_corpus.stdlib_root()
  modules = {stdlib_chat.module_name(p.relative_to(root).as_posix())
             for p in stdlib_corpus.stdlib_files(split)}
  with_tools = 0
  for record in records:
    messages = record["messages"]
    name, module = TASK.match(messages[0]["content"]).groups()
    assert module in modules  # the task comes from a file of this split
    code = CODE_BLOCK.match(messages[-1]["content"]).group(1)
    definition = ast.parse(code).body[0]  # the answer is valid Python defining that function
    assert isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef))
    assert definition.name == name and ast.get_docstring(definition)
    if "tools" in record:
      with_tools += 1
      user, call, result, answer = messages
      assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
      arguments = json.loads(call["tool_calls"][0]["function"]["arguments"])
      assert stdlib_corpus.split_of(arguments["path"]) == split
      assert arguments["path"] in result["content"] and "elided" in result["content"]
      assert code not in result["content"]  # the tool shows the context, never the answer
    else:
      assert [m["role"] for m in messages] == ["user", "assistant"]
  if split == "train":  # ~TOOL_USE_PER_MILLE of the tasks look at their context first
    assert 0.15 < with_tools / len(records) < 0.35


def test_records_are_deterministic():
  first = stdlib_chat.chat_records_json("heldout")
  stdlib_chat.chat_records_json.cache_clear()
  assert _digest(stdlib_chat.chat_records_json("heldout")) == _digest(first)
  train = stdlib_chat.chat_records_json("train")
  assert not set(train) & set(first)


def test_source_spec_and_random_access():
  assert sources.SourceSpec.parse("stdlib_chat") == sources.SourceSpec("stdlib_chat")
  with pytest.raises(ValueError):
    sources.SourceSpec("stdlib_chat", ("/some/path",))
  source = sources.open_source("stdlib_chat", "heldout")
  records = stdlib_chat.chat_records("heldout")
  assert len(source) == len(records)
  assert source[len(records) - 1] == records[-1] and source[0] == records[0]
  assert pickle.loads(pickle.dumps(source))[3] == records[3]  # grain worker processes


def _masked_runs(tokenizer, tokens, loss_mask) -> list[str]:
  """Decoded text of each maximal run of loss_mask == 1."""
  runs, start = [], None
  for index, on in enumerate(list(loss_mask) + [0]):
    if on and start is None:
      start = index
    elif not on and start is not None:
      runs.append(tokenizer.decode(tokens[start:index].tolist()))
      start = None
  return runs


def _assistant_texts(record) -> list[str]:
  """What each assistant message should contribute to the loss, written out by hand."""
  texts = []
  for message in record["messages"]:
    if message["role"] != "assistant":
      continue
    text = "<think></think>" + message["content"]
    if message.get("tool_calls"):
      call = message["tool_calls"][0]
      text += ("<|tool_calls_section_begin|><|tool_call_begin|>" + call["id"] +
               "<|tool_call_argument_begin|>" + call["function"]["arguments"] +
               "<|tool_call_end|><|tool_calls_section_end|>")
    texts.append(text + "<|im_end|>")
  return texts


def test_loss_mask_covers_exactly_the_assistant_replies(small_tokenizer):
  to_example = ConversationToExample(small_tokenizer)
  records = stdlib_chat.chat_records("heldout")
  assert any("tools" in r for r in records)
  for record in records:
    example = to_example.map(record)
    runs = _masked_runs(small_tokenizer, example["tokens"], example["loss_mask"])
    assert runs == _assistant_texts(record)
    # And what is not trained holds the prompt: system, user request, tool result, headers.
    unmasked = small_tokenizer.decode(example["tokens"][example["loss_mask"] == 0].tolist())
    assert chat.KIMI_DEFAULT_SYSTEM_PROMPT in unmasked
    assert record["messages"][0]["content"] in unmasked
    assert unmasked.count(kimi_vocab.IM_ASSISTANT + "assistant" + kimi_vocab.IM_MIDDLE) == len(runs)


def test_packed_sft_batches_train_only_assistant_tokens(small_tokenizer):
  iterator = pipeline.make_sft_iterator(
      source_spec="stdlib_chat", tokenizer=small_tokenizer, seq_len=512, batch_size=4, seed=0,
      process_index=0, process_count=1, split="heldout")
  trained = "".join(t for r in stdlib_chat.chat_records("heldout") for t in _assistant_texts(r))
  for _ in range(3):
    batch = next(iterator)
    assert 0 < batch["loss_mask"].mean() < 1
    for tokens, mask, segments in zip(batch["tokens"], batch["loss_mask"], batch["segment_ids"]):
      for segment in np.unique(segments[segments > 0]):
        in_segment = segments == segment
        for run in _masked_runs(small_tokenizer, tokens[in_segment], mask[in_segment]):
          assert run in trained  # pieces of assistant replies, never prompt or tool output
          assert kimi_vocab.IM_USER not in run and "## Return of" not in run
