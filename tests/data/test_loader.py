"""The global batch is the same whatever the number of processes reading it."""
import numpy as np

from c2.data import loader


def _batches(tokenizer, process_index, process_count, steps=3):
  iterator = loader.make_iterator(phase="pretrain", source="stdlib", tokenizer=tokenizer,
                                  seq_len=32, global_batch_size=4, seed=3, split="heldout",
                                  process_index=process_index, process_count=process_count)
  return [next(iterator) for _ in range(steps)], iterator


def test_process_count_does_not_change_the_global_batch(small_tokenizer):
  whole, _ = _batches(small_tokenizer, 0, 1)
  first, _ = _batches(small_tokenizer, 0, 2)
  second, _ = _batches(small_tokenizer, 1, 2)
  for step in range(3):
    for key in loader.BATCH_KEYS:
      joined = np.concatenate([first[step][key], second[step][key]])
      np.testing.assert_array_equal(whole[step][key], joined)
  assert whole[0]["tokens"].shape == (4, 32)
  assert not np.array_equal(whole[0]["tokens"][0], whole[0]["tokens"][1])  # shards differ


def test_state_round_trip_continues_exactly(small_tokenizer):
  batches, iterator = _batches(small_tokenizer, 0, 1, steps=2)
  state = iterator.get_state()
  expected = next(iterator)
  _, fresh = _batches(small_tokenizer, 0, 1, steps=0)
  fresh.set_state(state)
  np.testing.assert_array_equal(next(fresh)["tokens"], expected["tokens"])
