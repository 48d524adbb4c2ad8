"""Muon: momentum followed by Newton-Schulz orthogonalisation, for hidden weight matrices.

Shape glossary: G batch of matrices (stacked layers, experts, heads), R matrix rows (input
features), C matrix columns (output features).

The update of a weight W (R x C) is O = NS(M) * 0.2 * sqrt(max(R, C)), where M is the momentum
buffer and NS(M) ~ U V^T from the SVD M = U S V^T. An orthogonal R x C matrix has RMS
1/sqrt(max(R, C)), so the factor makes the update RMS 0.2, about what AdamW produces; learning
rate and weight decay tuned for AdamW then carry over (Moonlight's "update RMS matching", used by
Kimi K2's MuonClip). Weight decay and the learning rate are applied by the caller's chain
(c2/optim/optimizer.py), exactly as for AdamW.

Parameters with more than two dims (scanned layers [L,D,F], experts [L,E,D,F], per-head
projections [D,H,K]) are batches of matrices: `MatrixAxes` names the row and column axes, every
other axis is a batch axis and each matrix is orthogonalised on its own. QK-Clip is not here: it
rescales attention weights after the step and needs attention logits, so it belongs to the model.
"""
import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Quintic Newton-Schulz coefficients from Keller Jordan's Muon: chosen to push all singular values
# in (0, 1] into roughly [0.7, 1.2] within 5 steps, trading exactness for speed.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
UPDATE_RMS = 0.2


@dataclasses.dataclass(frozen=True)
class MatrixAxes:
  """Axes of a parameter that form the matrix rows and columns; all others are batch axes.

  Not a pytree node, so a tree of MatrixAxes has the parameters' structure. The default (last two
  dims) fits [D,F], [L,D,F] and [L,E,D,F]. For a per-head projection [D,H,K] use rows=(0,),
  cols=(2,) to orthogonalise each head separately or rows=(0,), cols=(1, 2) for one [D, H*K].
  """
  rows: tuple[int, ...] = (-2,)
  cols: tuple[int, ...] = (-1,)


def newton_schulz(matrices: jax.Array, *, steps: int = NS_STEPS,
                  coeffs: tuple[float, float, float] = NS_COEFFS,
                  eps: float = 1e-7) -> jax.Array:
  """Approximately orthogonalises each matrix of [..., R, C]; returns float32 [..., R, C].

  Iterates X <- a X + (b A + c A^2) X with A = X X^T on the wide orientation (R <= C), so A is the
  smaller Gram matrix. Dividing by the Frobenius norm first puts every singular value in [0, 1],
  inside the iteration's basin.
  """
  a, b, c = coeffs
  x = matrices.astype(jnp.float32)
  tall = x.shape[-2] > x.shape[-1]
  if tall:
    x = jnp.swapaxes(x, -1, -2)  # [..., C, R]
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
  x = x / (norm + eps)
  for _ in range(steps):
    gram = jnp.einsum("...ij,...kj->...ik", x, x)
    poly = b * gram + c * jnp.einsum("...ij,...jk->...ik", gram, gram)
    x = a * x + jnp.einsum("...ij,...jk->...ik", poly, x)
  return jnp.swapaxes(x, -1, -2) if tall else x


def _normalise_axes(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
  return tuple(a % ndim for a in axes)


def orthogonalised_update(grad: jax.Array, axes: MatrixAxes = MatrixAxes(), *,
                          steps: int = NS_STEPS) -> jax.Array:
  """NS(grad) * 0.2 * sqrt(max(R, C)) per matrix of `grad`, same shape, float32.

  The parameter is permuted to [batch..., rows..., cols...], reshaped to [G, R, C], orthogonalised
  and mapped back.
  """
  rows = _normalise_axes(axes.rows, grad.ndim)
  cols = _normalise_axes(axes.cols, grad.ndim)
  if set(rows) & set(cols) or not rows or not cols:
    raise ValueError(f"bad matrix axes {axes} for shape {grad.shape}")
  batch = tuple(a for a in range(grad.ndim) if a not in rows + cols)
  order = batch + rows + cols
  permuted = jnp.transpose(grad, order)
  num_rows = math.prod(grad.shape[a] for a in rows)
  num_cols = math.prod(grad.shape[a] for a in cols)
  matrices = permuted.reshape((-1, num_rows, num_cols))  # [G, R, C]
  update = newton_schulz(matrices, steps=steps) * (UPDATE_RMS * math.sqrt(max(num_rows, num_cols)))
  update = update.reshape(permuted.shape)  # [batch..., rows..., cols...]
  return jnp.transpose(update, tuple(order.index(a) for a in range(grad.ndim)))


class MuonState(NamedTuple):
  momentum: Any  # float32 tree like the parameters


def scale_by_muon(*, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = NS_STEPS,
                  matrix_axes: Callable[[Any], Any] | None = None) -> optax.GradientTransformation:
  """Muon direction for every leaf it receives (route only matrices here, e.g. via multi_transform).

  M_t = momentum * M_{t-1} + G_t; the orthogonalised matrix is M_t, or G_t + momentum * M_t with
  Nesterov. The result still has to be scaled by -learning_rate (and decayed) downstream.

  Args:
    momentum: mu.
    nesterov: use the Nesterov look-ahead.
    ns_steps: Newton-Schulz iterations.
    matrix_axes: function from an updates tree to a tree of MatrixAxes with the same structure;
      None means the last two dims of every leaf are the matrix.
  """
  def init_fn(params):
    return MuonState(momentum=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

  def update_fn(updates, state, params=None):
    del params
    new_momentum = jax.tree.map(lambda m, g: momentum * m + g.astype(jnp.float32),
                                state.momentum, updates)
    if nesterov:
      direction = jax.tree.map(lambda m, g: g.astype(jnp.float32) + momentum * m,
                               new_momentum, updates)
    else:
      direction = new_momentum
    if matrix_axes is None:
      axes_tree = jax.tree.map(lambda _: MatrixAxes(), updates)
    else:
      axes_tree = matrix_axes(updates)
    ortho = jax.tree.map(lambda d, ax: orthogonalised_update(d, ax, steps=ns_steps),
                         direction, axes_tree)
    return ortho, MuonState(momentum=new_momentum)

  return optax.GradientTransformation(init_fn, update_fn)
