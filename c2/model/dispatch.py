"""Dropless token dispatch for routed experts: sort by expert, grouped matmul, unsort, combine.

Glossary: N tokens (local), K experts per token, D model width, F expert FFN width, E experts,
E_ experts on this shard, P expert-parallel shards, C rows sent to one shard (capacity).

Without expert parallelism every token-choice (N * K of them) is sorted by expert, the expert
FFNs run as grouped matmuls over contiguous groups, and results are scattered back and mixed by
the combine weights. No token is ever dropped.

With expert parallelism (`expert_parallel_ffn`, inside `shard_map`) each shard sorts its own
token-choices by destination shard, exchanges them with an explicit all-to-all, runs its local
experts, and sends the results back with the reverse all-to-all:
  ragged           `lax.ragged_all_to_all`: exactly the rows each shard needs (TPU/GPU only).
  padded           `lax.all_to_all` of [P, C, D] buffers with C = N * K, so even the worst case
                   (every choice to one shard) fits: dropless, runs on CPU, P times the buffer.
Worst-case buffers cost P times the average; at full scale `capacity_factor` bounds them (e.g.
2x the average load, which the aux-loss-free bias keeps far from) and the few token-choices that
would overflow are dropped and counted in the `moe/dropped_fraction` metric.
  ragged_emulated  the ragged protocol's offsets and sizes, with the transfer emulated by an
                   all-gather; lets CPU tests check the exact offset arithmetic of `ragged`.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# gmm(lhs [M, K], rhs [G, K, N], group_sizes [G], expected_rows=None) -> [M, N]; expected_rows
# is how many of the M rows a balanced routing fills (a cost hint for kernels, see c2/ops/gmm.py).
GroupedMatmul = Callable[..., jax.Array]

# Names a remat policy can save (c2/model/block.py): the dispatched rows (saving them spares the
# backward pass a second all-to-all) and the expert matmul outputs (the silu and combine-weight
# backward need them; a Pallas kernel is no dot to jax's dots policies): the gate and up
# projections' [M, F] apart from the down projection's [M, D], to save one without the other.
DISPATCHED_ROWS = "moe_dispatched_rows"
EXPERT_GATE_UP, EXPERT_DOWN = "moe_expert_gate_up", "moe_expert_down"
# Capacities (multiples of the balanced load N * K / E, besides N) the padded-groups path picks
# from. Each is a branch compiled into the program: calls of up to FINE_STEPS_ABOVE tokens
# (decoding, prefill chunks, the CPU tests' steps) take two, larger ones (training batches)
# the finer steps, which made the tiny model's SFT step 1.16x faster but its compile slower
# (a CPU test's train step: 38 -> 48 s).
CAPACITY_STEPS = (1.0, 2.0)
FINE_CAPACITY_STEPS = (1.0, 1.25, 1.5, 2.0, 3.0)
FINE_STEPS_ABOVE = 1024


def expert_ffn(xs: jax.Array, group_sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
               w_down: jax.Array, gmm: GroupedMatmul,
               expected_rows: Optional[int] = None) -> jax.Array:
  """SwiGLU experts over rows grouped by expert. xs [M, D], w_gate/w_up [E, D, F], w_down [E, F, D]."""
  xs = checkpoint_name(xs, DISPATCHED_ROWS)
  matmul = lambda lhs, rhs, name: checkpoint_name(
      gmm(lhs, rhs, group_sizes, expected_rows=expected_rows), name)
  h = jax.nn.silu(matmul(xs, w_gate, EXPERT_GATE_UP)) * matmul(xs, w_up, EXPERT_GATE_UP)  # [M, F]
  return matmul(h, w_down, EXPERT_DOWN)  # [M, D]


def _combine(y_choices: jax.Array, weights: jax.Array) -> jax.Array:
  """y_choices [N * K, D] in token-major order, weights [N, K] -> [N, D] (float32 accumulate)."""
  n, k = weights.shape
  y = y_choices.reshape(n, k, -1)
  return jnp.einsum("NKD,NK->ND", y, weights.astype(y.dtype), preferred_element_type=jnp.float32)


def local_ffn(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
              w_up: jax.Array, w_down: jax.Array, gmm: GroupedMatmul) -> jax.Array:
  """All experts on this device. x [N, D], expert_ids/weights [N, K] -> [N, D] float32."""
  n, k = expert_ids.shape
  num_experts = w_gate.shape[0]
  flat_ids = expert_ids.reshape(-1)  # [N * K], token-major
  order = jnp.argsort(flat_ids, stable=True)
  xs = jnp.take(x, order // k, axis=0)  # [N * K, D], sorted by expert
  group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
  ys = expert_ffn(xs, group_sizes, w_gate, w_up, w_down, gmm)
  y_choices = jnp.zeros_like(ys).at[order].set(ys)  # back to token-major order
  return _combine(y_choices, weights)


def all_experts_ffn(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                    w_up: jax.Array, w_down: jax.Array,
                    token_mask: Optional[jax.Array] = None) -> jax.Array:
  """Routed experts without a sort or a grouped matmul (`gmm_impl="dense"`, what "auto" picks on
  CPU, where `ragged_dot` has no fast kernel): batched matmuls over the experts, dropless, in the
  form fastest for the number of tokens (`python -m c2.bench moe` measures the choice):
    N * K <= E / 2   each token through its own K experts (batch-1 decoding, a 2-token verify)
    N >= 16          per expert over its tokens, padded to a capacity that holds the largest group
                     (decode batches, prefill chunks, training batches)
    otherwise        every token through every expert, mixed by a dense [N, E] weight matrix
  token_mask [N] bool (optional): tokens outside it (padding, empty decode slots) must have zero
  weights; the padded groups leave them out, so they take no room in the largest group.
  """
  num_experts = w_gate.shape[0]
  n, k = expert_ids.shape
  if 2 * n * k <= num_experts:
    return _chosen_experts_ffn(x, expert_ids, weights, w_gate, w_up, w_down)
  if n >= 16:
    return _capacity_ffn(x, expert_ids, weights, w_gate, w_up, w_down, token_mask)
  return every_expert_ffn(x, expert_ids, weights, w_gate, w_up, w_down)


def every_expert_ffn(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                     w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """Every token through every expert, mixed by a dense [N, E] weight matrix (zero if unchosen):
  the same result as `local_ffn` at E/K times the expert FLOPs, as three batched matmuls."""
  num_experts = w_gate.shape[0]
  n = expert_ids.shape[0]
  mix = jnp.einsum("NK,NKE->NE", weights,
                   jax.nn.one_hot(expert_ids, num_experts, dtype=weights.dtype))  # [N, E]
  d = x.shape[-1]
  if n < w_gate.shape[-1]:
    # Few tokens (decoding): as a batched matmul over experts. The unbatched form makes XLA:CPU
    # transpose every expert's weights into a [E * F, D] matrix each call, which costs more than
    # copying x E times while N < F (measured 2-3x slower per layer at N = 1..16).
    x = jnp.broadcast_to(x, (num_experts, n, d))  # [E, N, D]
    g = jnp.einsum("END,EDF->ENF", x, w_gate)
    u = jnp.einsum("END,EDF->ENF", x, w_up)
  else:
    g = jnp.einsum("ND,EDF->ENF", x, w_gate)
    u = jnp.einsum("ND,EDF->ENF", x, w_up)
  y = jnp.einsum("ENF,EFD->END", jax.nn.silu(g) * u, w_down)
  return jnp.einsum("END,NE->ND", y, mix.astype(y.dtype), preferred_element_type=jnp.float32)


def _capacity_ffn(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array,
                  token_mask: Optional[jax.Array] = None) -> jax.Array:
  """Each expert on its own tokens, padded to a capacity C that holds the largest group: still
  dropless, with C the smallest of the capacity steps (CAPACITY_STEPS, or FINE_CAPACITY_STEPS above
  FINE_STEPS_ABOVE tokens) x the balanced load N * K / E (rounded up) and N that fits, picked per
  call by a lax.switch (the loads are only known on the device). Tokens outside token_mask are left
  out. Measured per tiny MoE layer on CPU inside a decode loop (a scan), with capacities of 1x and
  2x the balanced load and N: 180 vs 279 us for every token through every expert at N = 16 (largest
  group 6, C = 8), 1,184 vs 1,782 at N = 128 (a prefill chunk); no gain at N = 8, hence the lower
  bound. Forward + backward in bfloat16 (skewed routes, largest group ~0.35 N), alone: 38.6 vs 75.2
  ms at N = 1,536 (a copy-drill batch), 211 vs 427 at 9,216 (a tool-use SFT batch), 385 vs 791 at
  16,384. In the tiny model's whole training step the finer steps (1.25x, 1.5x, 3x) matter: its
  trained routers' largest groups were 1.2x, 1.7x and 2.5x the balanced load."""
  num_experts = w_gate.shape[0]
  n, k = expert_ids.shape
  flat = expert_ids.reshape(-1)  # [N * K] token-major choices
  if token_mask is not None:  # masked tokens' choices go to a virtual expert E, never placed
    flat = jnp.where(jnp.repeat(token_mask, k), flat, num_experts)
  loads = jnp.zeros(num_experts + 1, jnp.int32).at[flat].add(1)  # [E + 1]
  order = jnp.argsort(flat, stable=True)  # choices grouped by expert
  expert_of = flat[order]
  rank = jnp.arange(n * k) - (jnp.cumsum(loads) - loads)[expert_of]  # place in its group
  loads = loads[:num_experts]
  balanced = n * k / num_experts
  steps = FINE_CAPACITY_STEPS if n > FINE_STEPS_ABOVE else CAPACITY_STEPS
  capacities = sorted({min(n, math.ceil(m * balanced)) for m in steps} | {n})
  index = jnp.sum(jnp.asarray(capacities[:-1]) < jnp.max(loads))
  return _switch_with_local_vjp(index, [functools.partial(_padded_groups_ffn, c)
                                        for c in capacities],
                                (x, weights, w_gate, w_up, w_down), (order, expert_of, rank))


def _padded_groups_ffn(capacity, x, weights, w_gate, w_up, w_down, order, expert_of, rank):
  """The experts over [E, capacity] rows, each expert's token-choices first (rank < load) and
  the rest pointing at a zero row. order, expert_of, rank [N * K]: choices sorted by expert."""
  num_experts, (n, k), d = w_gate.shape[0], weights.shape, x.shape[-1]
  # [E, C] token of each (expert, place), N where the group is shorter; its combine weight.
  # Choices of the virtual expert E (masked tokens) fall outside the [E, C] tables: dropped.
  token = jnp.full((num_experts, capacity), n, jnp.int32).at[expert_of, rank].set(
      order // k, mode="drop")
  mix = jnp.zeros((num_experts, capacity), weights.dtype).at[expert_of, rank].set(
      weights.reshape(-1)[order], mode="drop")
  xs = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[token]  # [E, C, D]; row N: zeros
  g = jnp.einsum("ECD,EDF->ECF", xs, w_gate)
  u = jnp.einsum("ECD,EDF->ECF", xs, w_up)
  y = jnp.einsum("ECF,EFD->ECD", jax.nn.silu(g) * u, w_down)
  # Rounded as every_expert_ffn rounds its mix (to the experts' dtype), summed in float32.
  y = y.astype(jnp.float32) * mix.astype(y.dtype).astype(jnp.float32)[..., None]
  return jnp.zeros((n + 1, d), jnp.float32).at[token.reshape(-1)].add(y.reshape(-1, d))[:n]


def _switch_with_local_vjp(index, branches, diff_args: tuple, const_args: tuple):
  """lax.switch(index, branches, *diff_args, *const_args), differentiable in diff_args, whose
  backward pass runs the taken branch's own VJP (its forward recomputed there). Autodiff of a
  switch keeps the residuals of every branch, zeros for those not taken, and under a layer scan
  stacks them for every layer: for the tiny model's SFT step (9,216 tokens) writing those zeros
  cost more than the smaller capacities saved."""
  @jax.custom_vjp
  def switch(diff, const, index):
    return jax.lax.switch(index, branches, *diff, *const)

  def forward(diff, const, index):
    return switch(diff, const, index), (diff, const, index)

  def backward(residuals, cotangent):
    diff, const, index = residuals
    vjps = [lambda g, d, c, branch=branch: jax.vjp(lambda *d_: branch(*d_, *c), *d)[1](g)
            for branch in branches]
    grads = jax.lax.switch(index, vjps, cotangent, diff, const)
    return tuple(grads), (None,) * len(const), None

  switch.defvjp(forward, backward)
  return switch(tuple(diff_args), tuple(const_args), index)


def _chosen_experts_ffn(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                        w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """Each token through its own K experts only, their weights gathered: for so few tokens that
  the chosen experts' weights are at most half of all (batch-1 decoding, a 2-token speculative
  verify). Reading only those is what a memory-bound step costs. Measured per tiny MoE layer on
  CPU inside the engine's decode loop (a scan): 16 / 52 us at N = 1 / 2 against 91 / 109 for
  all experts; a `lax.switch` over static expert slices took 30 / 52 there but several times
  longer in the engine's step."""
  y = jnp.zeros(x.shape, jnp.float32)
  for choice in range(expert_ids.shape[1]):
    ids = expert_ids[:, choice]  # [N]
    g = jnp.einsum("ND,NDF->NF", x, jnp.take(w_gate, ids, axis=0))
    u = jnp.einsum("ND,NDF->NF", x, jnp.take(w_up, ids, axis=0))
    out = jnp.einsum("NF,NFD->ND", jax.nn.silu(g) * u, jnp.take(w_down, ids, axis=0))
    y = y + out.astype(jnp.float32) * weights[:, choice:choice + 1].astype(jnp.float32)
  return y


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def _sort_for_shards(x, expert_ids, experts_per_shard, num_shards):
  """Sorts token-choices by expert (hence by destination shard); returns what both paths need."""
  n, k = expert_ids.shape
  flat_ids = expert_ids.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)
  sorted_ids = flat_ids[order]
  xs = jnp.take(x, order // k, axis=0)  # [N * K, D]
  dest = sorted_ids // experts_per_shard  # non-decreasing destination shard
  send_sizes = jnp.bincount(dest, length=num_shards).astype(jnp.int32)  # [P]
  return order, sorted_ids % experts_per_shard, xs, dest, send_sizes


def _run_local_experts(rows, local_ids, num_local_experts, w_gate, w_up, w_down, gmm,
                       expected_rows):
  """rows [R, D] in any order with local expert ids (num_local_experts = empty slot) -> [R, D]."""
  order = jnp.argsort(local_ids, stable=True)  # empty slots sort last; gmm zeroes them
  group_sizes = jnp.bincount(local_ids, length=num_local_experts + 1)[:num_local_experts]
  ys = expert_ffn(jnp.take(rows, order, axis=0), group_sizes.astype(jnp.int32),
                  w_gate, w_up, w_down, gmm, expected_rows)
  return jnp.zeros_like(ys).at[order].set(ys)


def receive_rows(rows: int, num_shards: int, capacity_factor: Optional[float]) -> int:
  """Rows a shard can receive: the dropless worst case (every shard sends it everything) unless
  `capacity_factor` bounds it to that multiple of the average (rows per shard)."""
  worst = rows * num_shards
  if capacity_factor is None:
    return worst
  return min(worst, max(1, math.ceil(capacity_factor * rows)))


def _padded_exchange(xs, local_ids, dest, send_sizes, num_shards, axis_name, run_experts,
                     capacity_factor):
  rows, d = xs.shape
  # Per destination: all my rows in the worst case, else a share of the bounded receive buffer.
  capacity = receive_rows(rows, num_shards, capacity_factor) // num_shards
  capacity = max(1, min(rows, capacity))
  slot = jnp.arange(rows) - _exclusive_cumsum(send_sizes)[dest]
  kept = slot < capacity  # rows past a destination's capacity are dropped (counted)
  send_x = jnp.zeros((num_shards, capacity, d), xs.dtype).at[dest, slot].set(xs, mode="drop")
  send_ids = jnp.full((num_shards, capacity), -1, jnp.int32).at[dest, slot].set(local_ids,
                                                                                mode="drop")
  recv_x = jax.lax.all_to_all(send_x, axis_name, 0, 0, tiled=True)  # [P, C, D] by source
  recv_ids = jax.lax.all_to_all(send_ids, axis_name, 0, 0, tiled=True)
  y = run_experts(recv_x.reshape(-1, d), recv_ids.reshape(-1))
  back = jax.lax.all_to_all(y.reshape(num_shards, capacity, d), axis_name, 0, 0, tiled=True)
  ys = back.at[dest, slot].get(mode="fill", fill_value=0)  # [N * K, D] in sorted order
  return ys, jnp.sum(~kept)


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
  """Same contract as lax.ragged_all_to_all, built from all_gather (CPU-testable, slow)."""
  del recv_sizes  # implied by the senders' sizes, as in the real collective
  me = jax.lax.axis_index(axis_name)
  all_operands = jax.lax.all_gather(operand, axis_name)  # [P, rows, ...]
  all_in_off = jax.lax.all_gather(input_offsets, axis_name)  # [P(src), P(dst)]
  all_sizes = jax.lax.all_gather(send_sizes, axis_name)
  all_out_off = jax.lax.all_gather(output_offsets, axis_name)
  out_rows = jnp.arange(output.shape[0])
  for src in range(all_operands.shape[0]):
    start, size = all_out_off[src, me], all_sizes[src, me]
    inside = (out_rows >= start) & (out_rows < start + size)
    source_rows = jnp.clip(all_in_off[src, me] + out_rows - start, 0, operand.shape[0] - 1)
    picked = jnp.take(all_operands[src], source_rows, axis=0)
    mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
    output = jnp.where(mask, picked, output)
  return output


def _ragged_exchange(xs, local_ids, send_sizes, num_shards, axis_name, run_experts, emulate,
                     capacity_factor):
  a2a = _emulated_ragged_all_to_all if emulate else jax.lax.ragged_all_to_all
  rows, d = xs.shape
  me = jax.lax.axis_index(axis_name)
  all_sizes = jax.lax.all_gather(send_sizes, axis_name)  # [P(src), P(dst)]
  buffer_rows = receive_rows(rows, num_shards, capacity_factor)
  # Chunk of sender s lands on receiver d after the chunks of all lower-ranked senders; what
  # would spill past the receive buffer is not sent (dropped and counted).
  landing = _exclusive_cumsum(all_sizes, axis=0)  # [P(src), P(dst)]
  kept = jnp.clip(buffer_rows - landing, 0, all_sizes)  # [P(src), P(dst)]
  send_kept, recv_sizes = kept[me], kept[:, me]
  input_offsets = _exclusive_cumsum(send_sizes)
  output_offsets = jnp.minimum(landing[me], buffer_rows)
  recv_x = a2a(xs, jnp.zeros((buffer_rows, d), xs.dtype), input_offsets, send_kept,
               output_offsets, recv_sizes, axis_name=axis_name)
  recv_ids = a2a(local_ids, jnp.full((buffer_rows,), -1, jnp.int32), input_offsets, send_kept,
                 output_offsets, recv_sizes, axis_name=axis_name)
  y = run_experts(recv_x, recv_ids)
  # Reverse: the chunk I got from s sits at landing[s, me]; it returns to where s keeps its rows
  # for me (s's input offset at my index). Rows never sent come back as zeros.
  back_offsets = _exclusive_cumsum(all_sizes, axis=1)[:, me]
  ys = a2a(y, jnp.zeros((rows, d), y.dtype), jnp.minimum(landing[:, me], buffer_rows), recv_sizes,
           back_offsets, send_kept, axis_name=axis_name)
  return ys, jnp.sum(send_sizes - send_kept)


def expert_parallel_ffn(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                        w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                        gmm: GroupedMatmul, *, axis_name: str, num_shards: int, a2a_impl: str,
                        transport_fn: Optional[Callable[[jax.Array], jax.Array]] = None,
                        capacity_factor: Optional[float] = None) -> tuple[jax.Array, jax.Array]:
  """Inside shard_map: this shard's tokens x [N, D], routes [N, K]; w_* hold this shard's experts.

  `transport_fn` (e.g. MXFP8 quantise/dequantise) is applied to tokens before they travel.
  `capacity_factor` None keeps the receive buffers at the dropless worst case; a number bounds
  them to that multiple of the average load, dropping (and counting) what overflows.
  Returns (y [N, D] float32, number of token-choices dropped on this shard).
  """
  experts_per_shard = w_gate.shape[0]
  order, local_ids, xs, dest, send_sizes = _sort_for_shards(x, expert_ids, experts_per_shard,
                                                            num_shards)
  if transport_fn is not None:
    xs = transport_fn(xs)

  def run_experts(rows, ids):
    ids = jnp.where(ids < 0, experts_per_shard, ids)
    # Balanced routing fills as many rows of the receive buffer as this shard sends.
    return _run_local_experts(rows, ids, experts_per_shard, w_gate, w_up, w_down, gmm,
                              expected_rows=xs.shape[0])

  if a2a_impl == "padded":
    ys, dropped = _padded_exchange(xs, local_ids, dest, send_sizes, num_shards, axis_name,
                                   run_experts, capacity_factor)
  elif a2a_impl in ("ragged", "ragged_emulated"):
    ys, dropped = _ragged_exchange(xs, local_ids, send_sizes, num_shards, axis_name, run_experts,
                                   a2a_impl == "ragged_emulated", capacity_factor)
  else:
    raise ValueError(f"unknown all-to-all impl {a2a_impl!r}")
  y_choices = jnp.zeros_like(ys).at[order].set(ys)
  return _combine(y_choices, weights), dropped
