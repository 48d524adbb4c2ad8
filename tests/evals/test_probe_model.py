"""The probe's log-probs against the model's full logits, and its greedy completions against the
argmax continuation."""
import jax
import numpy as np
import pytest

from c2 import model
from c2.evals.probe_model import ProbeModel


def _logits(cfg, params, row):
  """Full logits [len(row), V] of one row; padded to 32 so one compile serves every call (causal:
  the padding after the row does not change it)."""
  padded = np.zeros((1, 32), np.int32)
  padded[0, :len(row)] = row
  return jax.jit(model.logits, static_argnums=0)(cfg, params, padded)[0, :len(row)]


def test_logprobs_and_completions_match_the_model(small_model, tokenizer):
  cfg, params = small_model
  probe = ProbeModel(cfg, params, tokenizer, context=32, batch=2, capacity=48, slots=2)
  rng = np.random.default_rng(0)
  rows = [list(rng.integers(3, cfg.vocab_size, n)) for n in (32, 7, 19)]  # 3 rows > batch 2
  got = probe.logprobs(rows)
  for row, logp in zip(rows, got):
    logits = _logits(cfg, params, row)
    ref = jax.nn.log_softmax(logits)[np.arange(len(row) - 1), np.asarray(row[1:])]
    assert logp.shape == (len(row),) and logp[0] == 0
    np.testing.assert_allclose(logp[1:], ref, atol=2e-5)
  with pytest.raises(ValueError, match="does not fit"):
    probe.logprobs([list(range(33))])
  nats = probe.answer_nats([rows[1][:4]], [rows[1][4:]])
  assert nats[0] == pytest.approx(-got[1][4:].sum(), rel=1e-5)

  prompt = rows[2][:10]
  [completion] = probe.complete([prompt], max_new_tokens=3)
  sequence = list(prompt)
  for _ in range(3):  # greedy: each token is the argmax given everything before it
    logits = _logits(cfg, params, sequence)[-1]
    sequence.append(int(np.argmax(logits)))
  assert completion == sequence[len(prompt):]
  assert [len(c) for c in probe.complete([prompt, prompt], max_new_tokens=[1, 4])] == [1, 4]
