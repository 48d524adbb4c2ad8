"""Copy drills over the tool-call tokens of transcripts (c2/data/copy_drills.py)."""
import json

import numpy as np
import pytest

from c2.data import copy_drills, loader
from c2.data.sources import SourceSpec


def _call(name, **arguments):
  return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


RECORDS = [
    {"messages": [{"role": "user", "content": "Set it."},
                  {"role": "assistant", "content": "",
                   "tool_calls": [_call("read_file", path="orbit/settings.py")]},
                  {"role": "tool", "content": "PAGE_SIZE = 25"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [_call("edit_file", path="orbit/settings.py",
                                        search="PAGE_SIZE = 25\n", replace="PAGE_SIZE = 50\n")]}]},
    # Arguments as an object rather than a JSON string, and a message without tool calls.
    {"messages": json.dumps([{"role": "assistant", "content": "hi"},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"function": {"name": "finish",
                                               "arguments": {"message": "Done."}}}]}])},
]


def test_the_alphabet_counts_every_token_of_the_tool_call_arguments(small_tokenizer):
  ids, counts = copy_drills.tool_call_alphabet(RECORDS, small_tokenizer)
  expected: dict = {}
  for text in (json.dumps({"path": "orbit/settings.py"}),
               json.dumps({"path": "orbit/settings.py", "search": "PAGE_SIZE = 25\n",
                           "replace": "PAGE_SIZE = 50\n"}),
               json.dumps({"message": "Done."})):
    for token in small_tokenizer.encode(text):
      expected[token] = expected.get(token, 0) + 1
  assert dict(zip(ids.tolist(), counts.tolist())) == expected
  assert list(counts) == sorted(counts, reverse=True)  # most frequent first
  with pytest.raises(ValueError, match="no tool calls"):
    copy_drills.tool_call_alphabet([{"messages": [{"role": "user", "content": "x"}]}],
                                   small_tokenizer)


def test_a_drill_is_a_span_shown_twice_with_loss_on_the_second_copy_only(small_tokenizer):
  ids, counts = np.arange(100, 140, dtype=np.int32), np.arange(40, 0, -1)
  drill = copy_drills.CopyDrill(small_tokenizer, ids, counts, row_tokens=48, seed=7)
  spans = set()
  for index in range(300):
    example = drill.map({"drill": index, "salt": 0})
    tokens, mask = example["tokens"], example["loss_mask"]
    assert tokens.shape == mask.shape == (48,) and tokens[0] == small_tokenizer.bos_id
    assert set(tokens[1:].tolist()) <= set(ids.tolist())
    targets = np.flatnonzero(mask)
    first, last = targets[0] - 1, targets[-1]  # the second copy is tokens[first:last + 1]
    span = last + 1 - first
    assert np.array_equal(targets, np.arange(first + 1, last + 1))  # contiguous, first excluded
    assert copy_drills.MIN_SPAN <= span <= 47 // 2 and first - span >= 1
    assert np.array_equal(tokens[first - span:first], tokens[first:last + 1])
    spans.add(int(span))
    assert np.array_equal(drill.map({"drill": index, "salt": 0})["tokens"], tokens)  # seeded
  assert len(spans) > 10  # lengths vary, so no fixed offset solves it
  train = [drill.map({"drill": i, "salt": 0})["tokens"] for i in range(20)]
  heldout = [drill.map({"drill": i, "salt": 1})["tokens"] for i in range(20)]
  assert all(not np.array_equal(a, b) for a, b in zip(train, heldout))
  # Tokens drawn ~ count ** 0.5: the most frequent id 6.3x as often as the rarest (40 / 1).
  drawn = np.concatenate([drill.map({"drill": i, "salt": 0})["tokens"][1:] for i in range(3000)])
  ratio = np.mean(drawn == ids[0]) / np.mean(drawn == ids[-1])
  assert 4.5 < ratio < 8.5
  weights = np.sqrt(counts) / np.sqrt(counts).sum()
  assert drill.alphabet_entropy() == pytest.approx(-(weights * np.log(weights)).sum())
  with pytest.raises(ValueError, match="seq_len=16 is too short"):
    copy_drills.CopyDrill(small_tokenizer, ids, counts, row_tokens=16, seed=0)


def test_far_drills_copy_short_spans_anywhere_later_in_the_row(small_tokenizer):
  ids, counts = np.arange(100, 400, dtype=np.int32), np.ones(300)
  drill = copy_drills.CopyDrill(small_tokenizer, ids, counts, row_tokens=256, seed=0, max_span=12)
  gaps = []
  for index in range(300):
    example = drill.map({"drill": index, "salt": 0})
    tokens, targets = example["tokens"], np.flatnonzero(example["loss_mask"])
    first, last = targets[0] - 1, targets[-1]
    span = last + 1 - first
    assert copy_drills.MIN_SPAN <= span <= 12
    assert np.array_equal(targets, np.arange(first + 1, last + 1))
    # The copied span occurs earlier in the row (uniform draws over 300 ids: one occurrence).
    sources = [s for s in range(1, first - span + 1)
               if np.array_equal(tokens[s:s + span], tokens[first:last + 1])]
    assert len(sources) == 1
    gaps.append(first - (sources[0] + span))
  assert min(gaps) >= 0 and max(gaps) > 150 and np.median(gaps) > 20  # far, and at every range
  with pytest.raises(ValueError, match="copy_drill_span=4 must be 0 or >= 8"):
    copy_drills.CopyDrill(small_tokenizer, ids, counts, row_tokens=256, seed=0, max_span=4)
  with pytest.raises(ValueError, match="seq_len=40 is too short"):
    copy_drills.CopyDrill(small_tokenizer, ids, counts, row_tokens=40, seed=0, max_span=20)


def test_the_copy_drills_source_through_the_loader(small_tokenizer, tmp_path, record_writer):
  record_writer(tmp_path, "jsonl", RECORDS * 3, name="train-0")
  spec = f"copy_drills:{tmp_path}/train-*.jsonl"
  assert SourceSpec.parse(spec) == SourceSpec("copy_drills", (f"{tmp_path}/train-*.jsonl",))
  alphabet = set(copy_drills.tool_call_alphabet(RECORDS, small_tokenizer)[0].tolist())

  def batches(split):
    iterator = loader.make_iterator(phase="pretrain", source=spec, tokenizer=small_tokenizer,
                                    seq_len=40, global_batch_size=4, seed=1, split=split,
                                    process_index=0, process_count=1)
    return [next(iterator) for _ in range(3)]

  train, again, heldout = batches("train"), batches("train"), batches("heldout")
  for batch in train + heldout:
    assert batch["tokens"].shape == (4, 40)
    assert (batch["segment_ids"] == 1).all()  # one drill fills one row
    assert (batch["tokens"][:, 0] == small_tokenizer.bos_id).all()
    assert set(batch["tokens"][:, 1:].ravel().tolist()) <= alphabet
    assert batch["loss_mask"].sum(1).min() >= copy_drills.MIN_SPAN - 1
  assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(train, again))
  assert not any(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(train, heldout))
