"""c2/perf/hlo_collectives.py: collective bytes of small programs compiled for a 4-chip v5p
(libtpu, compile only), against closed forms (loops counted by their trip counts)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from c2.perf import hlo_collectives

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytestmark = pytest.mark.tpu_aot

N = 4  # devices
ROWS, COLS, TRIPS = 128, 256, 5


def _mesh():
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
  return jax.sharding.Mesh(np.array(devices), ("x",))


def test_collectives_in_a_loop_count_every_trip():
  mesh = _mesh()

  def local(x_):  # x_ [ROWS / N, COLS] per device
    # tanh: a loop of plain sums would let XLA hoist the (linear) all-reduce out of the loop
    total = jax.lax.fori_loop(0, TRIPS, lambda _, acc: jnp.tanh(jax.lax.psum(acc, "x")), x_)
    return jax.lax.all_gather(total, "x", tiled=True)  # [ROWS, COLS]

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False))
  x = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  counted = hlo_collectives.count_collective_bytes(fn.lower(x).compile().as_text())
  shard = ROWS // N * COLS * 4
  assert counted["all-reduce"] == TRIPS * shard
  assert counted["all-gather"] == N * shard  # the gathered result, once
  assert counted["all-to-all"] == counted["reduce-scatter"] == 0


def test_all_to_all_counts_its_operand():
  mesh = _mesh()
  local = lambda x_: jax.lax.all_to_all(x_, "x", 0, 1, tiled=True)  # [32, 256] -> [128, 64]
  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = jax.ShapeDtypeStruct((ROWS, COLS), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
  counted = hlo_collectives.count_collective_bytes(fn.lower(x).compile().as_text())
  assert counted["all-to-all"] == ROWS // N * COLS * 2
