"""Oracle transcripts: graded rollouts in the SFT pipeline's chat schema."""
import json

from c2.data import kimi_vocab
from c2.data.examples import ConversationToExample
from c2.data.tokenizer import load_tokenizer
from c2.envs import task_generator, transcripts


def test_transcripts_are_graded_rollouts_in_the_sft_schema(tmp_path, tokenizer_512):
  tokenizer = load_tokenizer(str(tokenizer_512))
  assert transcripts.main(["--out", str(tmp_path), "--count", "7", "--heldout-count", "2",
                           "--workers", "2"]) == 0
  train = [json.loads(line) for line in (tmp_path / "train-00000.jsonl").read_text().splitlines()]
  heldout = (tmp_path / "heldout-00000.jsonl").read_text().splitlines()
  assert len(train) == 7 and len(heldout) == 2
  # The generator's ladder: the first 7 train tasks cover every level.
  tasks = task_generator.generate(0, 7, split="train")
  assert [r["task_id"] for r in train] == [t.task_id for t in tasks]
  for record, task in zip(train, tasks):
    roles = [m["role"] for m in record["messages"]]
    assert roles[:2] == ["system", "user"] and record["messages"][1]["content"] == task.prompt
    calls = [c["function"]["name"] for m in record["messages"] if m["role"] == "assistant"
             for c in m["tool_calls"]]
    assert calls[-1] == "finish" and len(calls) == len(task.solution) + (
        task.solution[-1]["name"] != "finish")
    # Every call got a real tool result, none an error.
    outputs = [m["content"] for m in record["messages"] if m["role"] == "tool"]
    assert len(outputs) == len(calls) and not any(o.startswith("Error:") for o in outputs)
    assert {t["function"]["name"] for t in record["tools"]} >= set(calls)

  # The SFT pipeline reads them: loss on the assistant turns (tool calls), not on tool outputs.
  example = ConversationToExample(tokenizer).map(train[0])
  tokens, mask = example["tokens"], example["loss_mask"].astype(bool)
  begin = tokenizer.special_id(kimi_vocab.TOOL_CALL_BEGIN)
  assistant_turns = [m for m in train[0]["messages"] if m["role"] == "assistant"]
  assert (tokens == begin).sum() == len(assistant_turns) and mask[tokens == begin].all()
  # Tool outputs are context: the tokens of a tool reply's header are never trained.
  tool_header = tokenizer.special_id(kimi_vocab.IM_SYSTEM)
  assert (tokens == tool_header).sum() >= len(assistant_turns) and not mask[tokens == tool_header].any()


def test_slipped_edits_are_context_and_the_recovery_is_trained(tokenizer_512):
  tokenizer = load_tokenizer(str(tokenizer_512))
  tasks = task_generator.generate(0, 4, split="train", levels=(1,))
  records = list(transcripts.oracle_transcripts(tasks, workers=2, slip_fraction=1.0))
  for record, task in zip(records, tasks):
    messages = record["messages"]
    slips = [i for i, m in enumerate(messages) if m.get("weight") == 0]
    assert len(slips) == 1, task.task_id
    slip = messages[slips[0]]["tool_calls"][0]["function"]
    arguments = json.loads(slip["arguments"])
    assert slip["name"] == "edit_file" and arguments["search"] == arguments["replace"]
    assert messages[slips[0] + 1]["content"].startswith("Error: edit_file: the search text")
    # The next reply is the same edit done right, and the rollout still scored 1.0 (else raised).
    retry = json.loads(messages[slips[0] + 2]["tool_calls"][0]["function"]["arguments"])
    assert retry["replace"] == arguments["replace"] and retry["search"] != arguments["search"]
    # Loss on every assistant reply but the slip: its tokens are in the row, never in the mask.
    example = ConversationToExample(tokenizer).map(record)
    tokens, mask = example["tokens"], example["loss_mask"].astype(bool)
    begin = tokenizer.special_id(kimi_vocab.TOOL_CALL_BEGIN)
    replies = [m for m in messages if m["role"] == "assistant"]
    assert (tokens == begin).sum() == len(replies)
    assert mask[tokens == begin].sum() == len(replies) - 1
  # A slip fraction of 0 reproduces the plain transcripts exactly.
  plain = list(transcripts.oracle_transcripts(tasks[:2], workers=2))
  assert plain == list(transcripts.oracle_transcripts(tasks[:2], workers=2, slip_fraction=0.0))
  assert not any("weight" in m for r in plain for m in r["messages"])


def test_no_op_slips_are_rejected_and_recovered_from():
  """`replacement_is_search` slips: the edit tool rejects the no-op, the oracle then edits right;
  with both kinds the edit slipped is the one the default kind slips (the kind is drawn after)."""
  tasks = task_generator.generate(0, 6, split="train", levels=(1,))
  both = ("search_is_replacement", "replacement_is_search")
  default = list(transcripts.oracle_transcripts(tasks, workers=2, slip_fraction=1.0))
  mixed = list(transcripts.oracle_transcripts(tasks, workers=2, slip_fraction=1.0,
                                              slip_kinds=both))
  kinds = []
  for plain, record in zip(default, mixed):
    slip_at = [i for i, m in enumerate(record["messages"]) if m.get("weight") == 0]
    assert slip_at == [i for i, m in enumerate(plain["messages"]) if m.get("weight") == 0]
    slip = json.loads(record["messages"][slip_at[0]]["tool_calls"][0]["function"]["arguments"])
    retry = json.loads(record["messages"][slip_at[0] + 2]["tool_calls"][0]["function"]["arguments"])
    error = record["messages"][slip_at[0] + 1]["content"]
    if slip["search"] == retry["replace"]:  # the new text copied where the old belongs
      kinds.append("search_is_replacement")
      assert slip["replace"] == retry["replace"]
      assert error.startswith("Error: edit_file: the search text does not occur")
    else:
      kinds.append("replacement_is_search")
      assert slip["search"] == slip["replace"] == retry["search"] != retry["replace"]
      assert error.startswith("Error: edit_file: `search` and `replace` are identical")
  assert set(kinds) == set(both), kinds  # six draws: both kinds occur for this seed
