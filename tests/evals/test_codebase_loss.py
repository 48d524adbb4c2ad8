"""Rolling-window nats: every token scored once with context, and the total is the text's, not the
tokenizer's: a byte-level bigram model expressed through two different BPE vocabularies gives the
same total (to float error), equal to the bigram log-likelihood of the bytes computed directly."""
import numpy as np
import pytest

from c2.data import default_tokenizer
from c2.data.tokenizer import HuggingFaceTokenizer
from c2.evals import codebase_loss

BOS = 256  # the bigram model's "no previous byte" state


@pytest.mark.parametrize("n,window,stride", [(1, 4, 2), (2, 4, 2), (10, 4, 1), (10, 4, 3),
                                             (100, 16, 8), (17, 16, 15), (5, 64, 32)])
def test_windows_score_each_token_once_with_context(n, window, stride):
  scored = np.zeros(n, int)
  for start, first, end in codebase_loss.rolling_windows(n, window, stride):
    assert end - start <= window and start < first <= end
    scored[first:end] += 1
    assert first - start >= min(first, window - stride)  # context of the first scored token
  assert scored[0] == 0 and np.all(scored[1:] == 1)
  with pytest.raises(ValueError, match="stride"):
    codebase_loss.rolling_windows(n, window, window)


def _token_bytes(tokenizer: HuggingFaceTokenizer) -> dict[int, bytes]:
  ranks = default_tokenizer.to_tiktoken_ranks(tokenizer.backend)
  return {i: b for b, i in ranks.items()}


def _bigram_scorer(table: np.ndarray, token_bytes: dict[int, bytes], bos_id: int):
  """Per-token log p under a byte bigram model: the token's bytes, each given the byte before it
  (the previous token's last byte; BOS at the stream start). Defined on bytes, so any
  tokenization of a text gets the same total if, and only if, every token is scored once with
  its predecessor present."""
  def score_rows(rows):
    out = []
    for row in rows:
      logp = np.zeros(len(row))
      for t in range(1, len(row)):
        prev_token = row[t - 1]
        prev = BOS if prev_token == bos_id else token_bytes[prev_token][-1]
        for b in token_bytes[row[t]]:
          logp[t] += table[prev, b]
          prev = b
      out.append(logp)
    return out
  return score_rows


def _direct_bigram_nats(table, data: bytes) -> float:
  prev, total = BOS, 0.0
  for b in data:
    total -= table[prev, b]
    prev = b
  return total


def test_total_nats_invariant_to_tokenizer(tokenizer_512, tmp_path):
  fine = HuggingFaceTokenizer.from_file(tokenizer_512)
  coarse_path = default_tokenizer.ensure_default_tokenizer(tmp_path, vocab_size=300,
                                                           max_train_bytes=100_000)
  coarse = HuggingFaceTokenizer.from_file(coarse_path)
  text = codebase_loss.stdlib_text(max_bytes=6000) + "\n# naïve café → ∑ 🙂 ünïcödé\n"
  data = text.encode("utf-8")
  logits = np.random.default_rng(0).normal(size=(257, 256)) * 2
  table = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  expected = _direct_bigram_nats(table, data)
  totals = {}
  for name, tok in (("fine", fine), ("coarse", coarse)):
    ids = tok.encode(text)
    bos = tok.bos_id
    scorer = _bigram_scorer(table, _token_bytes(tok), bos)
    for window, stride in ((64, 32), (128, 1 + 64), (16, 15)):
      out = codebase_loss.codebase_loss(text, tok.encode, scorer, window=window, stride=stride,
                                        bos_id=bos)
      totals[name, window, stride] = out["nats"]
      assert out["bytes"] == len(data)
    totals[name, "tokens"] = len(ids)
  # The two vocabularies really cut the text differently...
  assert totals["coarse", "tokens"] > 1.3 * totals["fine", "tokens"]
  # ...and the totals agree with each other and with the bytes' own log-likelihood.
  residuals = [abs(v - expected) / expected for k, v in totals.items() if k[1] != "tokens"]
  assert max(residuals) < 1e-12, residuals
  # A per-token uniform model is not tokenizer-invariant: the check can tell the difference.
  uniform = lambda tok: (lambda rows: [np.r_[0.0, np.full(len(r) - 1, -np.log(tok.vocab_size))]
                                       for r in rows])
  a = codebase_loss.codebase_loss(text, fine.encode, uniform(fine), window=64, stride=32,
                                  bos_id=fine.bos_id)["nats"]
  b = codebase_loss.codebase_loss(text, coarse.encode, uniform(coarse), window=64, stride=32,
                                  bos_id=coarse.bos_id)["nats"]
  assert abs(a - b) / a > 0.1
