"""Builders the trainer calls: checkpointable iterators of packed [B_local, T] batches.

Order of operations (a grain dataset graph, see build_dataset):
  records (random access) -> global shuffle (seed; reshuffled each epoch) -> repeat(num_epochs)
  -> this process's slice [process_index::process_count] -> tokenise / render (read threads)
  -> drop examples under min_example_tokens (long-context phases) -> cut to seq_len
  -> first-fit packing -> batch -> batch contract (c2/data/packing.py)

Sharding slices the one global shuffled stream, so processes see disjoint records that together
cover each epoch, and no process needs to know what the others read.

Resuming: the returned iterator is grain's `DatasetIterator`; `get_state()` is a small JSON-able
dict (or use grain.checkpoint.CheckpointSave/Restore with Orbax) and `set_state(state)` on a freshly
built iterator continues with exactly the next batch. Build it with the same arguments, including
num_workers: grain splits records among worker processes, so the worker count shapes the stream.

With finite `num_epochs` (held-out evaluation), processes may produce different numbers of
batches, since each packs its own slice; evaluate a fixed number of batches on every process.
"""
from __future__ import annotations

import functools

import grain

from c2.data import copy_drills
from c2.data import examples as examples_lib
from c2.data import packing
from c2.data import sources
from c2.data.tokenizer import Tokenizer


def _process_slot(process_index: int | None, process_count: int | None) -> tuple[int, int]:
  if process_index is None or process_count is None:
    import jax  # only consulted when the caller does not say (tests pass both explicitly)
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} outside [0, {process_count})")
  return process_index, process_count


class MinLength(grain.transforms.Filter):
  """Keeps examples of at least `min_tokens` tokens (a class, not a lambda: worker processes
  pickle it)."""

  def __init__(self, min_tokens: int):
    self.min_tokens = min_tokens

  def filter(self, example) -> bool:
    return len(example["tokens"]) >= self.min_tokens


def build_dataset(*, source_spec: str | sources.SourceSpec, to_example: grain.transforms.Map,
                  seq_len: int, batch_size: int, pad_id: int, seed: int, split: str,
                  process_index: int | None = None, process_count: int | None = None,
                  num_epochs: int | None = None, num_packing_bins: int | None = None,
                  read_threads: int = 1, num_workers: int = 0,
                  min_example_tokens: int = 0) -> grain.IterDataset:
  """The grain dataset of batches; `iter()` it for a checkpointable iterator.

  Args:
    to_example: record -> {"tokens", "loss_mask"} (c2/data/examples.py); a RandomMap gets
      grain's per-element generator (seeded by `seed` and the element's index).
    num_epochs: None repeats forever (training); an int stops after that many passes.
    num_packing_bins: rows packed at once (default max(batch_size, 64)).
    read_threads: threads that read and tokenise records ahead of packing.
    num_workers: >0 moves the whole pipeline into that many worker processes.
    min_example_tokens: drop shorter examples before cutting and packing (long-context phases
      fill rows with one long document instead of many short ones packed together).
  """
  process_index, process_count = _process_slot(process_index, process_count)
  records = grain.MapDataset.source(sources.open_source(source_spec, split))
  if len(records) == 0:
    raise ValueError(f"source {source_spec!r} has no records for split {split!r}")
  # Shuffle before repeat: grain's shuffle draws a new permutation for each epoch index range.
  records = records.shuffle(seed=seed).repeat(num_epochs)
  records = records[process_index::process_count]
  examples = (records.random_map(to_example, seed=seed)
              if isinstance(to_example, grain.transforms.RandomMap) else records.map(to_example))
  examples = examples.to_iter_dataset(
      grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(4 * read_threads, 8)))
  if min_example_tokens:
    examples = examples.filter(MinLength(min_example_tokens))
  examples = grain.experimental.FlatMapIterDataset(examples, examples_lib.CutToLength(seq_len))
  rows = packing.pack_examples(examples, seq_len=seq_len, pad_id=pad_id, seed=seed,
                               num_packing_bins=num_packing_bins or max(batch_size, 64))
  batches = packing.batch_rows(rows, batch_size)
  if num_workers > 0:
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return batches


def make_lm_iterator(*, source_spec: str | sources.SourceSpec, tokenizer: Tokenizer,
                     seq_len: int, batch_size: int, seed: int,
                     process_index: int | None = None, process_count: int | None = None,
                     split: str = "train", num_epochs: int | None = None,
                     text_field: str = "text", repeat_fraction: float = 0.0,
                     copy_drill_span: int = 0,
                     **options) -> grain.DatasetIterator:
  """Language-modelling batches: documents `[BOS] text [EOS]`, every token a target.

  Returns a grain DatasetIterator yielding dicts of numpy arrays tokens / segment_ids / positions
  (int32) and loss_mask (float32), each [batch_size, seq_len] (contract in c2/data/packing.py).
  `options` go to build_dataset (num_packing_bins, read_threads, num_workers,
  min_example_tokens). repeat_fraction: copy drills in documents
  (examples_lib.DocumentOrCopyDrill; copy_drill_span > 0: needles copied within the document).
  A copy_drills source (c2/data/copy_drills.py) replaces documents; copy_drill_span sets its
  far-copy layout.
  """
  spec = sources.SourceSpec.parse(source_spec)
  if spec.kind == "copy_drills":
    to_example = make_copy_drill(spec, tokenizer, seq_len=seq_len, seed=seed,
                                 max_span=copy_drill_span)
  elif repeat_fraction:
    to_example = examples_lib.DocumentOrCopyDrill(tokenizer, text_field, fraction=repeat_fraction,
                                                  max_tokens=seq_len, max_span=copy_drill_span)
  else:
    to_example = examples_lib.DocumentToExample(tokenizer, text_field)
  dataset = build_dataset(
      source_spec=source_spec, to_example=to_example,
      seq_len=seq_len, batch_size=batch_size, pad_id=tokenizer.pad_id, seed=seed, split=split,
      process_index=process_index, process_count=process_count, num_epochs=num_epochs, **options)
  return iter(dataset)


def make_copy_drill(spec: sources.SourceSpec, tokenizer: Tokenizer, *, seq_len: int,
                    seed: int, max_span: int = 0) -> copy_drills.CopyDrill:
  """The drill transform of a copy_drills source: its alphabet from the train transcripts (both
  splits drill the same tokens)."""
  ids, counts = _tool_call_alphabet(tuple(str(p) for p in spec.resolve_paths("train")), tokenizer)
  return copy_drills.CopyDrill(tokenizer, ids, counts, row_tokens=seq_len, seed=seed,
                               max_span=max_span)


@functools.lru_cache(maxsize=4)  # one pipeline per data shard: tokenise the transcripts once
def _tool_call_alphabet(paths: tuple[str, ...], tokenizer: Tokenizer):
  records = sources.JsonlSource(paths)
  return copy_drills.tool_call_alphabet([records[i] for i in range(len(records))], tokenizer)


def make_sft_iterator(*, source_spec: str | sources.SourceSpec, tokenizer: Tokenizer,
                      seq_len: int, batch_size: int, seed: int,
                      process_index: int | None = None, process_count: int | None = None,
                      split: str = "train", num_epochs: int | None = None,
                      train_on: str = "current_turn", **options) -> grain.DatasetIterator:
  """SFT batches from {"messages": [...], "tools": [...]} records, loss on assistant tokens only.

  Same batch contract as make_lm_iterator; `train_on` picks which assistant replies carry loss
  ("current_turn": after the last user message; "all_assistant": every reply).
  """
  missing = tokenizer.missing_special_tokens()
  if missing:
    raise ValueError(f"the chat template needs special tokens the tokenizer lacks: {missing}")
  dataset = build_dataset(
      source_spec=source_spec,
      to_example=examples_lib.ConversationToExample(tokenizer, train_on=train_on),
      seq_len=seq_len, batch_size=batch_size, pad_id=tokenizer.pad_id, seed=seed, split=split,
      process_index=process_index, process_count=process_count, num_epochs=num_epochs, **options)
  return iter(dataset)
