"""Reference statistics of tokenised data, for judging a model's loss and a tokenizer.

Entropies are in **nats** (natural log), the unit of the cross-entropy loss the trainer reports,
so "held-out loss < unigram entropy of held-out targets" is a direct comparison: a model that beats
it has learned more than token frequencies. The plug-in estimate from the evaluated data itself is
a slightly optimistic (low) bar for a unigram model fitted elsewhere, which only makes the test
stricter.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from c2.data.tokenizer import Tokenizer


def entropy_of_counts(counts: np.ndarray) -> float:
  """Shannon entropy in nats of the distribution proportional to `counts`."""
  counts = np.asarray(counts, np.float64)
  counts = counts[counts > 0]
  if counts.size == 0:
    raise ValueError("no tokens to measure")
  probabilities = counts / counts.sum()
  return float(-(probabilities * np.log(probabilities)).sum())


def unigram_entropy(tokens: np.ndarray, mask: np.ndarray | None = None) -> float:
  """Entropy (nats/token) of the token frequency distribution, over tokens where mask > 0."""
  tokens = np.asarray(tokens).reshape(-1)
  if mask is not None:
    tokens = tokens[np.asarray(mask).reshape(-1) > 0]
  _, counts = np.unique(tokens, return_counts=True)
  return entropy_of_counts(counts)


def target_unigram_entropy(batches: Iterable[Mapping[str, np.ndarray]]) -> float:
  """Unigram entropy (nats/token) of the *targets* in batches of the pipeline's contract.

  Counts exactly the tokens the loss is averaged over (loss_mask > 0), so it compares with the
  mean loss of the same batches.
  """
  targets = [np.asarray(b["tokens"])[np.asarray(b["loss_mask"]) > 0] for b in batches]
  return unigram_entropy(np.concatenate(targets))


def chars_per_token(tokenizer: Tokenizer, texts: Iterable[str]) -> float:
  """Compression of a tokenizer on some texts: characters per token (higher is better)."""
  num_chars = num_tokens = 0
  for text in texts:
    num_chars += len(text)
    num_tokens += len(tokenizer.encode(text))
  return num_chars / max(num_tokens, 1)
