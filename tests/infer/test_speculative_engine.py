"""Speculative sampling through the whole engine (MTP drafts with their caches, one verifying
forward, the acceptance rule) reproduces plain sampling: chi-square of the 2nd and 3rd completion
tokens of 1,200 seeded requests against their exact marginals, enumerated with the full forward
over every 1- and 2-token continuation of a 16-token vocabulary."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from c2 import model
from c2.infer import Engine, Request, SamplingParams

VOCAB, SAMPLES, PROMPT = 16, 1200, [3, 9, 4, 12, 7]


def exact_marginals(cfg, params):
  """P(token 1), P(token 2), P(token 3) of the completion, by enumeration."""
  def next_dist(prefixes):
    rows = jnp.array([PROMPT + list(p) for p in prefixes])
    return np.asarray(jax.nn.softmax(model.logits(cfg, params, rows)[:, -1], -1), np.float64)

  p1 = next_dist([()])[0]
  p2_given = next_dist([(a,) for a in range(VOCAB)])  # [V, V]
  pairs = list(itertools.product(range(VOCAB), repeat=2))
  p3_given = next_dist(pairs).reshape(VOCAB, VOCAB, VOCAB)
  p2 = p1 @ p2_given
  p3 = np.einsum("a,ab,abc->c", p1, p2_given, p3_given)
  return p1, p2, p3


def chisquare_p(counts, probs, min_expected=5.0):
  """Chi-square p-value, pooling the categories expected fewer than min_expected times."""
  expected = counts.sum() * probs / probs.sum()
  small = expected < min_expected
  if small.any():
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
  return stats.chisquare(counts, expected).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("draft_depth", [1, 2])
def test_speculative_engine_samples_the_model_distribution(small_cfg, draft_depth):
  cfg = small_cfg.replace(vocab_size=VOCAB)
  params = model.init_params(cfg, jax.random.key(3))
  marginals = exact_marginals(cfg, params)
  engine = Engine(cfg, params, slots=64, capacity=16, prefill_chunk=8, prefill_rows=8,
                  draft_depth=draft_depth)
  results = engine.generate([Request(PROMPT, SamplingParams(max_new_tokens=3, temperature=1.0,
                                                            seed=s)) for s in range(SAMPLES)])
  tokens = np.array([r.token_ids for r in results])
  assert engine.stats["accepted_depth_1"] > 0  # drafts were really accepted and used
  for position, probs in enumerate(marginals):
    counts = np.bincount(tokens[:, position], minlength=VOCAB)
    assert chisquare_p(counts, probs) > 1e-3, (position, counts, np.round(probs * SAMPLES))
