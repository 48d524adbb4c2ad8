"""Eval tests: a stand-in probe whose answers are scripted, and one small random-init model."""
import jax
import pytest

from c2.data.tokenizer import HuggingFaceTokenizer


class ScriptedProbe:
  """ProbeModel's interface with scripted behaviour: `answer(prompt_text) -> completion text`
  for greedy completions, and a constant per-token log-prob for scoring."""

  def __init__(self, tokenizer, answer, *, context=256, capacity=None, logp=-1.0):
    self.tokenizer, self.answer = tokenizer, answer
    self.context, self.capacity, self.logp = context, capacity or context, logp
    self.prompts = []

  def complete(self, prompts, max_new_tokens):
    self.prompts += prompts
    return [self.tokenizer.encode(self.answer(self.tokenizer.decode(p[1:]))) for p in prompts]

  def logprobs(self, rows, length=None):
    import numpy as np
    return [np.r_[0.0, np.full(len(r) - 1, self.logp)] for r in rows]

  def answer_nats(self, prompts, answers, length=None):
    return [-self.logp * len(a) for a in answers]


@pytest.fixture(scope="session")
def tokenizer(tokenizer_512):
  return HuggingFaceTokenizer.from_file(tokenizer_512)


@pytest.fixture(scope="session")
def small_model(small_cfg):
  """(cfg, params) of the small test model, random init (compiled forward shared by tests)."""
  from c2 import model
  return small_cfg, model.init_params(small_cfg, jax.random.key(0))
