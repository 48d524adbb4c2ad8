"""One program for training and the AOT check, and the loop's safety rails: the transfer guard,
phase validation before anything runs."""
import jax.numpy as jnp
import numpy as np
import pytest

from c2 import config as config_lib
from c2.cli import load_experiment
from c2.data import loader
from c2.perf import aot
from c2.train import loop


def _lowered_text(program, state, batch) -> str:
  with program.context():
    return program.train_step.lower(state, batch).as_text()


def test_aot_lowers_the_program_the_trainer_runs(small_experiment, tmp_path):
  """The trainer's step, lowered with its real state and first real batch on the 8-device CPU
  mesh, is the module c2.perf.aot lowers from shapes alone for the same devices."""
  build, seed_dir = small_experiment
  exp = build()
  run = loop.prepare(exp, seed_dir(tmp_path / "run"))
  assert run.program.mesh.size == 8
  batch = loader.to_global(next(run.train_iter), run.program.mesh)
  trainer = _lowered_text(run.program, run.state, batch)
  checked = aot.program_on(exp, list(run.program.mesh.devices.flat)).lower().as_text()
  assert trainer == checked
  # The comparison sees a one-number difference in the step (it would have caught the old
  # trainer/AOT split, whose jits differed in out_shardings).
  other = build(**{"train.bias_update_rate": 2e-3})
  assert aot.program_on(other, list(run.program.mesh.devices.flat)).lower().as_text() != checked
  run.checkpointer.close()


def test_the_step_loop_refuses_implicit_transfers(small_experiment, tmp_path, monkeypatch):
  """The loop runs under transfer_guard("disallow"): the real loop passes (other tests run it),
  and one implicit host-to-device copy slipped into it stops the run."""
  build, seed_dir = small_experiment
  exp = build(**{"train.steps": 2})
  real = loader.to_global

  def leaky(local_batch, mesh):
    jnp.asarray(np.zeros(2))  # an implicit copy, as `x + numpy_array` on device data would do
    return real(local_batch, mesh)

  monkeypatch.setattr(loader, "to_global", leaky)
  with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
    loop.run(exp, seed_dir(tmp_path / "leaky"))


@pytest.mark.parametrize("phase", ["long_context"])
def test_a_phase_without_a_step_is_rejected_by_config_validation(phase, monkeypatch):
  """Before any data is read or state restored: the ConfigDict -> ExperimentConfig conversion
  (the first thing c2.main and c2.aot do) refuses it and names the registry. (Every phase has a
  step now; one is unregistered for the test.)"""
  from c2.steps import STEPS  # pylint: disable=import-outside-toplevel
  monkeypatch.delitem(STEPS, phase)
  c = load_experiment("experiments/pretrain.py:tiny")
  c.phase = phase
  with pytest.raises(config_lib.ConfigError, match=f"config.phase='{phase}' has no train step"):
    config_lib.from_config_dict(c)
  import c2.main  # pylint: disable=import-outside-toplevel
  with pytest.raises(config_lib.ConfigError, match="c2.steps.STEPS"):
    c2.main.parse(["c2.main", "--config=experiments/pretrain.py:tiny", f"--config.phase={phase}",
                   "--workdir=/nonexistent"])
