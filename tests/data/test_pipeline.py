"""The builders: resume exactness, per-process shards, seeded shuffling, SFT loss masks."""
import collections
import json
import re

import numpy as np
import pytest

from c2.data import packing, pipeline

DOCS = [{"text": f"doc {i:03d} says hello"} for i in range(23)]
CHATS = [{"messages": [{"role": "user", "content": f"question {i}"},
                       {"role": "assistant", "content": f"answer {i}"}]} for i in range(9)]


def lm_iterator(tokenizer, **overrides):
  arguments = dict(source_spec="stdlib", tokenizer=tokenizer, seq_len=128, batch_size=4, seed=3,
                   process_index=0, process_count=1)
  return pipeline.make_lm_iterator(**(arguments | overrides))


def take(iterator, count):
  return [next(iterator) for _ in range(count)]


def assert_same_batches(first, second):
  assert len(first) == len(second)
  for a, b in zip(first, second):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def segment_texts(tokenizer, batches):
  texts = []
  for batch in batches:
    for row_tokens, row_segments in zip(batch["tokens"], batch["segment_ids"]):
      for segment in np.unique(row_segments[row_segments > 0]):
        texts.append(tokenizer.decode(row_tokens[row_segments == segment].tolist()))
  return texts


@pytest.mark.parametrize("read_threads", [1, 2])
def test_lm_resume_continues_with_the_exact_next_batch(small_tokenizer, read_threads):
  iterator = lm_iterator(small_tokenizer, read_threads=read_threads)
  take(iterator, 5)
  state = json.loads(json.dumps(iterator.get_state()))  # the checkpoint is plain JSON
  expected = take(iterator, 3)
  resumed = lm_iterator(small_tokenizer, read_threads=read_threads)
  resumed.set_state(state)
  assert_same_batches(take(resumed, 3), expected)


def test_sft_resume_continues_with_the_exact_next_batch(tmp_path, record_writer, small_tokenizer):
  path = record_writer(tmp_path, "jsonl", CHATS)

  def build():
    return pipeline.make_sft_iterator(source_spec=str(path), tokenizer=small_tokenizer, seq_len=64,
                                      batch_size=2, seed=1, process_index=0, process_count=1)

  iterator = build()
  take(iterator, 4)
  state = json.loads(json.dumps(iterator.get_state()))
  expected = take(iterator, 4)
  resumed = build()
  resumed.set_state(state)
  assert_same_batches(take(resumed, 4), expected)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrayrecord"])
def test_process_shards_partition_the_stream(tmp_path, record_writer,
                                                          small_tokenizer, kind):
  path = record_writer(tmp_path, kind, DOCS)
  seen = []
  for process_index in range(3):
    # batch_size 1 never drops a remainder, so every document of the shard comes out.
    batches = list(pipeline.make_lm_iterator(
        source_spec=str(path), tokenizer=small_tokenizer, seq_len=64, batch_size=1, seed=7,
        process_index=process_index, process_count=3, num_epochs=2))
    texts = segment_texts(small_tokenizer, batches)
    assert all(t.startswith("[BOS]doc ") and t.endswith(" says hello[EOS]") for t in texts)
    seen.append(collections.Counter(int(re.search(r"doc (\d+)", t).group(1)) for t in texts))
  # The shards partition the global stream: over two epochs every document is read exactly twice
  # in total (which process reads it may change between epochs, as the order is reshuffled).
  total = sum(seen, collections.Counter())
  assert total == collections.Counter({i: 2 for i in range(len(DOCS))})


def test_single_epoch_shards_are_disjoint(tmp_path, record_writer, small_tokenizer):
  path = record_writer(tmp_path, "jsonl", DOCS)
  shards = []
  for process_index in range(2):
    batches = pipeline.make_lm_iterator(
        source_spec=str(path), tokenizer=small_tokenizer, seq_len=64, batch_size=1, seed=7,
        process_index=process_index, process_count=2, num_epochs=1)
    shards.append({t for t in segment_texts(small_tokenizer, batches)})
  assert not shards[0] & shards[1]
  assert len(shards[0] | shards[1]) == len(DOCS)
  assert abs(len(shards[0]) - len(shards[1])) <= 1


def test_shuffle_is_seeded(small_tokenizer):
  first = take(lm_iterator(small_tokenizer, seed=11), 2)
  assert_same_batches(take(lm_iterator(small_tokenizer, seed=11), 2), first)
  other = take(lm_iterator(small_tokenizer, seed=12), 2)
  assert not np.array_equal(other[0]["tokens"], first[0]["tokens"])


def test_lm_batches_follow_the_contract(small_tokenizer):
  for batch in take(lm_iterator(small_tokenizer), 3):
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "tokens": ((4, 128), "int32"), "segment_ids": ((4, 128), "int32"),
        "positions": ((4, 128), "int32"), "loss_mask": ((4, 128), "float32")}
    expected_mask = (batch["segment_ids"] > 0) & (batch["positions"] > 0)
    np.testing.assert_array_equal(batch["loss_mask"], expected_mask.astype(np.float32))
    assert packing.fill_ratio(batch) > 0.9  # long stdlib files fill rows almost completely


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_sft_loss_mask_covers_only_assistant_replies(tmp_path, record_writer, small_tokenizer,
                                                     kind):
  path = record_writer(tmp_path, kind, CHATS)
  batches = list(pipeline.make_sft_iterator(
      source_spec=str(path), tokenizer=small_tokenizer, seq_len=64, batch_size=1, seed=0,
      process_index=0, process_count=1, num_epochs=1))
  trained = []
  for batch in batches:
    tokens, mask = batch["tokens"][0], batch["loss_mask"][0]
    # Runs of consecutive trained tokens, decoded.
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    trained += [small_tokenizer.decode(tokens[s:e].tolist()) for s, e in zip(edges[::2], edges[1::2])]
  assert sorted(trained) == sorted(f"<think></think>answer {i}<|im_end|>" for i in range(len(CHATS)))


def test_copy_drills_repeat_a_fresh_shuffled_part_of_the_chosen_share_of_documents(
    small_tokenizer):
  """data.repeat_fraction: that share of documents is `[BOS] a a [EOS]`, `a` a random 8 to
  (seq_len - 2) // 2 tokens drawn from its distinct tokens, both copies in one segment of one
  row, loss on the second copy and EOS only; the draws come from grain's per-element generator, so the same document gives a different
  drill on another pass, and the same seed gives the same stream."""
  import grain  # pylint: disable=import-outside-toplevel
  from c2.data.examples import DocumentOrCopyDrill, DocumentToExample  # pylint: disable=import-outside-toplevel
  drill = DocumentOrCopyDrill(small_tokenizer, fraction=0.5, max_tokens=40)
  plain = DocumentToExample(small_tokenizer)
  texts = [f"def function_{i}(x):\n    return x * {i} + {i * i}\n" for i in range(200)]
  records = grain.MapDataset.source([{"text": t} for t in texts])
  drilled = list(records.random_map(drill, seed=3))
  assert [e["tokens"].tolist() for e in drilled] == [
      e["tokens"].tolist() for e in records.random_map(drill, seed=3)]  # seeded
  repeated = 0
  for text, example in zip(texts, drilled):
    ids, got = small_tokenizer.encode(text), example["tokens"].tolist()
    if got == plain.map({"text": text})["tokens"].tolist():
      continue
    repeated += 1
    half = (len(got) - 2) // 2  # 8 to (40 - 2) // 2 = 19 of the text's tokens, then again
    part = got[1:1 + half]
    assert 8 <= half <= min(19, len(ids))
    assert got == [small_tokenizer.bos_id, *part, *part, small_tokenizer.eos_id]
    assert set(part) <= set(ids)
    assert example["loss_mask"].tolist() == [0] * (1 + half) + [1] * (half + 1)  # 2nd copy, EOS
  assert 75 <= repeated <= 125  # about half of 200
  # An empty document stays a document (nothing to draw from).
  always = DocumentOrCopyDrill(small_tokenizer, fraction=1.0, max_tokens=40)
  empty = list(grain.MapDataset.source([{"text": ""}]).random_map(always, seed=0))[0]
  assert empty["tokens"].tolist() == plain.map({"text": ""})["tokens"].tolist()
  # Another pass over the same documents (the next epoch's indices) draws other drills.
  again = list(grain.MapDataset.source([{"text": t} for t in texts]).repeat(2).random_map(
      drill, seed=3))[200:]
  assert sum(a["tokens"].tolist() != b["tokens"].tolist() for a, b in zip(drilled, again)) > 100
  # Through the pipeline: every segment of the first batches is a repeated half.
  batches = take(lm_iterator(small_tokenizer, repeat_fraction=1.0), 2)
  for batch in batches:
    for row, segments in zip(batch["tokens"], batch["segment_ids"]):
      for segment in np.unique(segments[segments > 0]):
        body = row[segments == segment][1:-1]  # without BOS and EOS
        half = len(body) // 2
        assert len(body) == 2 * half and np.array_equal(body[:half], body[half:])


def test_needle_drills_copy_a_span_of_the_document_over_a_later_part_of_it(small_tokenizer):
  """data.repeat_fraction with data.copy_drill_span N: the document's first max_tokens - 1
  tokens, a span of 8 to N of them copied over a later stretch; loss on the copy after its first
  token only; everything else is the document's own text."""
  import grain  # pylint: disable=import-outside-toplevel
  from c2.data.examples import DocumentOrCopyDrill  # pylint: disable=import-outside-toplevel
  max_tokens, max_span = 64, 12
  drill = DocumentOrCopyDrill(small_tokenizer, fraction=1.0, max_tokens=max_tokens,
                              max_span=max_span)
  texts = [" ".join(f"word{i}_{k}" for k in range(40)) for i in range(100)]
  spans, distances = [], []
  for text, example in zip(texts, grain.MapDataset.source([{"text": t} for t in texts]).random_map(
      drill, seed=5)):
    ids = small_tokenizer.encode(text)[:max_tokens - 1]
    got, mask = example["tokens"], example["loss_mask"]
    assert got[0] == small_tokenizer.bos_id and len(got) == len(ids) + 1 == max_tokens
    body = got[1:]
    changed = np.flatnonzero(body != np.asarray(ids))
    trained = np.flatnonzero(mask) - 1  # positions in the body
    # The loss covers one contiguous copy, from its second token on.
    assert len(trained) >= 7 and np.array_equal(trained, np.arange(trained[0], trained[-1] + 1))
    copy, span = trained[0] - 1, len(trained) + 1
    assert 8 <= span <= max_span
    assert set(changed) <= set(range(copy, copy + span))  # only the copy overwrote the text
    originals = [s for s in range(0, copy - span + 1)
                 if np.array_equal(body[s:s + span], body[copy:copy + span])]
    assert originals, "the copy repeats no earlier stretch of the row"
    spans.append(span)
    distances.append(copy - originals[-1])
  assert len(set(spans)) > 3 and max(distances) > 2 * max_span  # random spans, read from afar
  with pytest.raises(ValueError, match="copy_drill_span"):
    DocumentOrCopyDrill(small_tokenizer, fraction=1.0, max_tokens=max_tokens, max_span=40)
