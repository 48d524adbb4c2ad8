"""Which optimizer treats which parameter: groups, decay masks and Muon matrix axes by path.

Rules are regular expressions searched in the '/'-joined parameter path (e.g.
'moe_layers/block/moe/gate'), so they read like the checkpoint. tests/optim checks them against
the real model's parameter tree.
"""
import re
from typing import Any, Sequence

import jax

from c2.optim.muon import MatrixAxes

# Norm scales, biases, the router's selection bias and embeddings are not decayed: shrinking them
# changes the function without regularising capacity. The router bias is moved by
# c2.model.update_router_biases; list it in frozen_patterns so the optimizer never touches it.
DEFAULT_NO_DECAY_PATTERNS = (r"(^|/)(scale|bias)$", r"correction_bias", r"(^|/)embed")
# Muon is for hidden matrices; the embedding and output head are lookups/readouts whose rows see
# very different gradient scales, so they stay on AdamW (Moonlight, K2).
DEFAULT_ADAMW_ONLY_PATTERNS = (r"embed", r"(^|/)(lm_)?head", r"norm", r"(^|/)(scale|bias)$",
                               r"correction_bias")

# Muon must orthogonalise the matrix the layer actually applies. The MLA projections in
# c2/model/attention.py are stored per head, [in, H, K] (q, q_b, kv_b) and [H, J, out] (out), so
# the default "last two dims" would orthogonalise one [H, K] block per input row instead of the
# [in, H*K] matrix. Negative axes keep a leading scanned-layers axis a batch axis. First match
# wins; unmatched parameters use the last two dims. (Per-head Muon, as in Composer 2.5's sharded
# Muon, would instead use rows=(-3,), cols=(-1,) for q_b.)
DEFAULT_MATRIX_AXES_RULES = (
    (r"(^|/)(q|q_b|kv_b)$", MatrixAxes(rows=(-3,), cols=(-2, -1))),
    (r"(^|/)out$", MatrixAxes(rows=(-3, -2), cols=(-1,))),
)


def path_string(key_path: Sequence[Any]) -> str:
  """'/'-joined names of a jax key path: ('layers', 0, 'attn', 'q_proj', 'kernel') ->
  'layers/0/attn/q_proj/kernel'. nnx Variables add a trailing '.value' attribute; it is dropped so
  patterns anchored at the end ('bias$') work for nnx state and plain dicts alike."""
  names = []
  for key in key_path:
    if isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value":
      continue
    for field in ("key", "name", "idx"):
      if hasattr(key, field):
        names.append(str(getattr(key, field)))
        break
    else:
      names.append(str(key))
  return "/".join(names)


def _matches(path: str, patterns: Sequence[str]) -> bool:
  return any(re.search(p, path) for p in patterns)


def path_mask(params: Any, patterns: Sequence[str]) -> Any:
  """Tree of bools like params: True where any regex in `patterns` searches the path."""
  return jax.tree_util.tree_map_with_path(lambda kp, _: _matches(path_string(kp), patterns),
                                          params)


def matrix_axes_for(path: str, rules: Sequence[tuple[str, MatrixAxes]]) -> MatrixAxes:
  """The MatrixAxes of the first rule whose regex searches `path`; default the last two dims."""
  return next((axes for pattern, axes in rules if re.search(pattern, path)), MatrixAxes())


def param_groups(params: Any, *, frozen_patterns: Sequence[str] = (), use_muon: bool = False,
                 adamw_only_patterns: Sequence[str] = DEFAULT_ADAMW_ONLY_PATTERNS) -> Any:
  """Tree of 'frozen' | 'muon' | 'adamw' like params. Frozen wins; Muon takes every trainable
  parameter with >= 2 dims that no adamw_only pattern matches."""
  def group(key_path, leaf):
    path = path_string(key_path)
    if _matches(path, frozen_patterns):
      return "frozen"
    if use_muon and leaf.ndim >= 2 and not _matches(path, adamw_only_patterns):
      return "muon"
    return "adamw"

  return jax.tree_util.tree_map_with_path(group, params)
