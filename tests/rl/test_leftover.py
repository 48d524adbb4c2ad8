"""Sequences that did not fit a batch (their groups already counted trained) survive a restart:
saved beside each checkpoint, loaded for the step a run resumes from, pruned with checkpoints."""
import numpy as np

from c2.rl import learner
from c2.rl.packing import TrainSequence


def _sequence(n, advantage, group):
  rng = np.random.default_rng(n)
  return TrainSequence(tokens=rng.integers(0, 100, n).astype(np.int32),
                       loss_mask=np.arange(n) >= 3, sampler_logp=-rng.random(n).astype(np.float32),
                       advantage=advantage, routes=rng.integers(0, 8, (n - 1, 2, 2)).astype(np.uint16),
                       group=group)


def _same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.tokens, y.tokens)
    np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
    np.testing.assert_array_equal(x.sampler_logp, y.sampler_logp)
    np.testing.assert_array_equal(x.routes, y.routes)
    assert (x.advantage, x.group) == (y.advantage, y.group)


def test_leftover_follows_the_checkpoints(tmp_path):
  directory = str(tmp_path / "rl")
  at_2, at_4 = [_sequence(9, 0.5, 3), _sequence(5, -0.25, 3)], [_sequence(7, 1.0, 6)]
  learner.save_leftover(directory, 2, at_2)
  learner.save_leftover(directory, 4, at_4)
  # A crash after step 4's file but before its checkpoint: the resume (at step 2) finds step 2's.
  _same(learner.load_leftover(directory, 2), at_2)
  _same(learner.load_leftover(directory, 4), at_4)
  assert learner.load_leftover(directory, 3) == []
  learner.prune_leftover(directory, [4])  # the checkpointer keeps step 4 only
  assert learner.load_leftover(directory, 2) == []
  _same(learner.load_leftover(directory, 4), at_4)
  assert sorted(p.name for p in (tmp_path / "rl").iterdir()) == ["leftover-000000004.pkl"]
