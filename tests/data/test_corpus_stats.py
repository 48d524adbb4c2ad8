"""Reference statistics: unigram entropy in nats, chars per token."""
import math

import numpy as np
import pytest

from c2.data import corpus_stats


def test_unigram_entropy_in_nats():
  assert corpus_stats.unigram_entropy(np.array([[0, 1], [2, 3]])) == pytest.approx(math.log(4))
  assert corpus_stats.unigram_entropy(np.array([5, 5, 5])) == pytest.approx(0.0)
  skewed = np.array([0, 0, 0, 1])
  assert corpus_stats.unigram_entropy(skewed) == pytest.approx(
      -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


def test_mask_selects_the_counted_tokens():
  tokens = np.array([0, 1, 2, 3, 9, 9])
  mask = np.array([1, 1, 1, 1, 0, 0], np.float32)
  assert corpus_stats.unigram_entropy(tokens, mask) == pytest.approx(math.log(4))


def test_target_entropy_counts_loss_mask_positions_across_batches():
  batches = [{"tokens": np.array([[7, 0, 1]]), "loss_mask": np.array([[0.0, 1.0, 1.0]])},
             {"tokens": np.array([[7, 2, 3]]), "loss_mask": np.array([[0.0, 1.0, 1.0]])}]
  assert corpus_stats.target_unigram_entropy(batches) == pytest.approx(math.log(4))


def test_chars_per_token(small_tokenizer):
  text = "def main():\n    return 0\n"
  expected = len(text) / len(small_tokenizer.encode(text))
  assert corpus_stats.chars_per_token(small_tokenizer, [text, text]) == pytest.approx(expected)


def test_empty_input_is_an_error():
  with pytest.raises(ValueError):
    corpus_stats.unigram_entropy(np.array([], np.int32))
