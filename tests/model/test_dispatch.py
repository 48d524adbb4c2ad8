"""Dropless dispatch: every token reaches all its top-k experts, on one device and across shards."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from c2.parallel import mesh as meshlib
from c2.model import dispatch
from c2.ops.gmm import grouped_matmul

N, D, F, E, K = 64, 16, 8, 8, 2


def _weights(seed=0):
  rng = np.random.default_rng(seed)
  mk = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2]), jnp.float32)
  return mk(E, D, F), mk(E, D, F), mk(E, F, D)


def _reference(x, ids, w, gate, up, down):
  """Per token, per choice, the expert's SwiGLU written out directly."""
  x, ids, w = map(np.asarray, (x, ids, w))
  gate, up, down = map(np.asarray, (gate, up, down))
  out = np.zeros_like(x)
  for n in range(x.shape[0]):
    for j in range(ids.shape[1]):
      e = ids[n, j]
      g, u = x[n] @ gate[e], x[n] @ up[e]
      out[n] += w[n, j] * ((g / (1 + np.exp(-g))) * u) @ down[e]
  return out


def _routes(seed, skewed):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
  if skewed:  # every token picks experts 0 and 1: a capacity-based dispatch would drop most
    ids = np.tile([0, 1], (N, 1))
  else:
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
  w = jnp.asarray(rng.uniform(0.1, 1.0, size=(N, K)), jnp.float32)
  return x, jnp.asarray(ids, jnp.int32), w


@pytest.mark.parametrize("impl", ["ragged_dot", "dense"])
@pytest.mark.parametrize("skewed", [False, True])
def test_local_dispatch_is_dropless(impl, skewed):
  x, ids, w = _routes(0, skewed)
  gate, up, down = _weights()
  gmm = functools.partial(grouped_matmul, impl=impl)
  out = dispatch.local_ffn(x, ids, w, gate, up, down, gmm)
  np.testing.assert_allclose(out, _reference(x, ids, w, gate, up, down), rtol=1e-4, atol=1e-5)


# 1, 2: the chosen experts; 3: all experts; 16, 64: per-expert groups padded to the largest
@pytest.mark.parametrize("tokens,skewed", [(1, False), (2, False), (3, False), (16, False),
                                           (64, False), (16, True)])  # skewed: largest group N
def test_all_experts_ffn_equals_reference_and_its_gradient(tokens, skewed):
  x, ids, w = _routes(1, skewed=skewed)
  x, ids, w = x[:tokens], ids[:tokens], w[:tokens]
  gate, up, down = _weights()
  out = dispatch.all_experts_ffn(x, ids, w, gate, up, down)
  np.testing.assert_allclose(out, _reference(x, ids, w, gate, up, down), rtol=1e-4, atol=1e-5)
  # Gradients to the inputs, the combine weights and every expert's weights (the unchosen get 0).
  gmm = functools.partial(grouped_matmul, impl="ragged_dot")
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))
  args = (x, w, gate, up, down)
  dense = jax.grad(loss(lambda x, w, *ws: dispatch.all_experts_ffn(x, ids, w, *ws)),
                   argnums=range(5))(*args)
  sorted_ = jax.grad(loss(lambda x, w, *ws: dispatch.local_ffn(x, ids, w, *ws, gmm)),
                     argnums=range(5))(*args)
  for a, b in zip(dense, sorted_):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("largest", [8, 9, 12, 13, 24, 32])
def test_each_capacity_of_the_padded_groups_gives_the_reference_and_its_gradient(largest,
                                                                                monkeypatch):
  """32 tokens, balanced load 8, with the fine capacity steps of training batches: capacities 8,
  10, 12, 16, 24, 32. Expert 0 gets `largest` token-choices, so each capacity (and the one above
  an exact fit) is the branch that runs, in the forward pass and in the backward pass, which runs
  that branch's own VJP."""
  monkeypatch.setattr(dispatch, "FINE_STEPS_ABOVE", 0)
  tokens = 32
  # The other choices go round experts 1..7 (consecutive ones differ), none above `largest`.
  cycle = iter(1 + np.arange(64) % (E - 1))
  ids = np.array([[0, next(cycle)] if i < largest else [next(cycle), next(cycle)]
                  for i in range(tokens)], np.int32)
  assert np.bincount(ids.ravel()).max() == largest
  rng = np.random.default_rng(largest)
  x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
  w = jnp.asarray(rng.uniform(0.1, 1.0, size=(tokens, K)), jnp.float32)
  args = (x, w) + _weights(2)
  loss = lambda fn: lambda x, w, *ws: jnp.sum(jnp.sin(fn(x, jnp.asarray(ids), w, *ws)))
  value, grads = jax.value_and_grad(loss(dispatch.all_experts_ffn), argnums=range(5))(*args)
  ref_value, ref_grads = jax.value_and_grad(loss(dispatch.every_expert_ffn),
                                            argnums=range(5))(*args)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-5)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert float(jnp.abs(grads[2][0]).max()) > 0  # expert 0's gate weights get their gradient


def test_masked_tokens_take_no_room_in_the_padded_groups(monkeypatch):
  """Padding tokens (all alike, all to expert 0) outside token_mask are left out of the groups:
  the capacity holds the real tokens' largest group, and every output equals the reference (the
  padding's, with zero weights, is 0). Capacities are checked by making each one record itself."""
  x, ids, w = _routes(4, skewed=False)
  pad = np.arange(N) >= 40  # 24 padding tokens, all choosing experts 0 and 1
  ids = jnp.where(pad[:, None], jnp.array([0, 1]), ids)
  w = jnp.where(pad[:, None], 0.0, w)
  gate, up, down = _weights(3)
  ran = []
  real = dispatch._padded_groups_ffn
  monkeypatch.setattr(dispatch, "_padded_groups_ffn",
                      lambda c, *a: jax.debug.callback(lambda: ran.append(c)) or real(c, *a))
  out = dispatch.all_experts_ffn(x, ids, w, gate, up, down, token_mask=jnp.asarray(~pad))
  np.testing.assert_allclose(out, _reference(x, ids, w, gate, up, down), rtol=1e-4, atol=1e-5)
  largest_real = np.bincount(np.asarray(ids)[~pad].ravel(), minlength=E).max()
  assert ran and ran[-1] < N and ran[-1] >= largest_real  # 24 + padding would need C = N


@pytest.mark.parametrize("impl", ["ragged_dot", "dense"])
def test_grouped_matmul_groups_and_tail(impl):
  rng = np.random.default_rng(3)
  lhs = jnp.asarray(rng.normal(size=(10, 4)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.float32)
  sizes = jnp.array([3, 0, 5])  # empty group, and rows 8..9 belong to no group
  out = np.asarray(grouped_matmul(lhs, rhs, sizes, impl=impl))
  np.testing.assert_allclose(out[:3], np.asarray(lhs[:3] @ rhs[0]), rtol=1e-5)
  np.testing.assert_allclose(out[3:8], np.asarray(lhs[3:8] @ rhs[2]), rtol=1e-5)
  np.testing.assert_array_equal(out[8:], 0.0)


@pytest.mark.parametrize("a2a_impl", ["padded", "ragged_emulated"])
@pytest.mark.parametrize("skewed", [False, True])
def test_expert_parallel_equals_reference(a2a_impl, skewed):
  """4 expert shards x 2 data shards; each shard owns 2 experts and an eighth of the tokens."""
  x, ids, w = _routes(1, skewed)
  gate, up, down = _weights(1)

  out, dropped = _expert_parallel(x, ids, w, gate, up, down, a2a_impl, None)
  np.testing.assert_allclose(out, _reference(x, ids, w, gate, up, down), rtol=1e-4, atol=1e-5)
  assert int(dropped) == 0


def _expert_parallel(x, ids, w, gate, up, down, a2a_impl, capacity_factor):
  """4 expert shards x 2 data shards; returns (output, token-choices dropped in total)."""
  mesh = meshlib.make_mesh({"data": 2, "expert": 4})
  gmm = functools.partial(grouped_matmul, impl="ragged_dot")

  def body(x_, ids_, w_, gate_, up_, down_):
    y, dropped = dispatch.expert_parallel_ffn(
        x_, ids_, w_, gate_, up_, down_, gmm, axis_name="expert", num_shards=4,
        a2a_impl=a2a_impl, capacity_factor=capacity_factor)
    return y, jax.lax.psum(dropped, ("data", "expert"))

  tokens, experts = P(("data", "expert")), P("expert")
  with jax.set_mesh(mesh):
    return jax.jit(jax.shard_map(body, in_specs=(tokens, tokens, tokens, experts, experts, experts),
                                 out_specs=(tokens, P()), check_vma=False))(x, ids, w, gate, up,
                                                                            down)


def _expected_drops(ids, a2a_impl, capacity_factor):
  """Token-choices over the bounded buffers, from the routing alone (8 shards of 8 tokens)."""
  ids = np.asarray(ids).reshape(8, 8 * K)  # [token shard, choices]; data-major like the mesh
  expert_shard = ids // 2  # 2 experts per expert shard
  rows = 8 * K
  sizes = np.stack([np.bincount(row, minlength=4) for row in expert_shard])  # [src, dst]
  buffer = min(rows * 4, int(np.ceil(capacity_factor * rows)))
  if a2a_impl == "padded":
    per_destination = max(1, min(rows, buffer // 4))
    return int(np.maximum(sizes - per_destination, 0).sum())
  dropped = 0
  for group in range(2):  # the all-to-all runs within each data row of 4 expert shards
    received = sizes[group * 4:(group + 1) * 4].sum(0)
    dropped += int(np.maximum(received - buffer, 0).sum())
  return dropped


@pytest.mark.parametrize("a2a_impl", ["padded", "ragged_emulated"])
def test_bounded_buffers_drop_only_the_overflow(a2a_impl):
  x, ids, w = _routes(1, skewed=True)  # every choice to experts 0, 1: all on expert shard 0
  gate, up, down = _weights(1)
  out, dropped = _expert_parallel(x, ids, w, gate, up, down, a2a_impl, capacity_factor=2.0)
  expected = _expected_drops(ids, a2a_impl, 2.0)
  assert int(dropped) == expected > 0
  # Generous buffers: identical to the dropless result.
  out_full, dropped_full = _expert_parallel(x, ids, w, gate, up, down, a2a_impl, 4.0)
  assert int(dropped_full) == 0
  np.testing.assert_allclose(out_full, _reference(x, ids, w, gate, up, down), rtol=1e-4,
                             atol=1e-5)
