"""Train-package tests: the trainer's own program on a chosen mesh, stepped outside the loop."""
import jax
import pytest

from c2.parallel import mesh as meshlib
from c2.train import program as program_lib


@pytest.fixture
def program_on():
  """program_on(exp, mesh=None) -> (fresh state, step(state, batch)) of c2.train.program.build;
  the default mesh is one device."""
  def build(exp, mesh=None):
    mesh = mesh or meshlib.make_mesh({}, devices=jax.devices()[:1])
    program = program_lib.build(exp, mesh)

    def step(state, batch):
      with program.context():
        return program.train_step(state, batch)

    return program.init_state(0), step

  return build
