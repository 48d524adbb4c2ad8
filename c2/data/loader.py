"""Trainer-facing glue: the phase's iterator from plain settings, and host batches -> global arrays.

The global batch is made of `global_batch_size` virtual data shards, one row each per step:
shard s reads records s, s + S, s + 2S, ... of the shuffled stream and packs them into its own
rows. A process runs the pipelines of the shards whose rows its devices hold, so it reads only
its share of the data, and the global batch is the same whatever the number of processes: a
2-host run sees exactly the batches of a 1-host run (tested). The global array is assembled
without any host holding all of it (`jax.make_array_from_process_local_data`).
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding

from c2.parallel import sharding
from c2.data import pipeline
from c2.data.tokenizer import Tokenizer

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


class ShardedRows:
  """This process's rows of the global batch: one row from each of its virtual shards per step.

  Checkpointable like a grain iterator: `get_state()` is a JSON-able dict of the shards' states.
  """

  def __init__(self, shard_iterators: dict[int, object],
               transform: Optional[Callable[[dict], dict]] = None):
    self._iterators = shard_iterators
    self._transform = transform  # e.g. c2.data.zigzag's layout, applied to the packed rows

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    rows = [next(iterator) for iterator in self._iterators.values()]  # each [1, T]
    batch = {key: np.concatenate([row[key] for row in rows]) for key in rows[0]}
    return self._transform(batch) if self._transform else batch

  def get_state(self) -> dict:
    return {str(shard): iterator.get_state() for shard, iterator in self._iterators.items()}

  def set_state(self, state: dict) -> None:
    if set(state) != {str(shard) for shard in self._iterators}:
      raise ValueError(f"data state holds shards {sorted(state)} but this process reads "
                       f"{sorted(self._iterators)}: resume with the same global_batch_size and "
                       "process layout")
    for shard, iterator in self._iterators.items():
      iterator.set_state(state[str(shard)])


def make_iterator(*, phase: str, source: str, tokenizer: Tokenizer, seq_len: int,
                  global_batch_size: int, seed: int, split: str,
                  num_epochs: Optional[int] = None, text_field: str = "text",
                  sft_train_on: str = "current_turn", read_threads: int = 1,
                  num_workers: int = 0, min_doc_tokens: int = 0, repeat_fraction: float = 0.0,
                  copy_drill_span: int = 0,
                  process_index: Optional[int] = None, process_count: Optional[int] = None,
                  batch_transform: Optional[Callable[[dict], dict]] = None) -> ShardedRows:
  """The checkpointable iterator of this process's [B_local, T] batches for a phase.
  min_doc_tokens (language modelling only): documents shorter than this are skipped.
  repeat_fraction (language modelling only): copy drills (c2/data/examples.py).
  copy_drill_span: the far-copy layout of a copy_drills source (c2/data/copy_drills.py), or of
  the repeat_fraction drills (needles within the document)."""
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if global_batch_size % process_count:
    raise ValueError(f"config.data.global_batch_size={global_batch_size} is not divisible by the "
                     f"{process_count} processes")
  per_process = global_batch_size // process_count
  shards = range(process_index * per_process, (process_index + 1) * per_process)
  make = pipeline.make_sft_iterator if phase == "sft" else pipeline.make_lm_iterator
  extra = ({"train_on": sft_train_on} if phase == "sft"
           else {"text_field": text_field, "min_example_tokens": min_doc_tokens,
                 "repeat_fraction": repeat_fraction, "copy_drill_span": copy_drill_span})
  return ShardedRows({
      shard: make(source_spec=source, tokenizer=tokenizer, seq_len=seq_len, batch_size=1,
                  seed=seed, process_index=shard, process_count=global_batch_size, split=split,
                  num_epochs=num_epochs, read_threads=read_threads, num_workers=num_workers,
                  num_packing_bins=16, **extra)
      for shard in shards}, batch_transform)


def batch_sharding(mesh: jax.sharding.Mesh, global_shape: tuple[int, ...],
                   names: tuple = ("batch", "length")) -> NamedSharding:
  spec = sharding.logical_to_spec(names, global_shape, dict(mesh.shape))
  return NamedSharding(mesh, spec)


def batch_axis_names(key: str, ndim: int) -> tuple:
  """Logical names of a batch array: [B, T] arrays, and the RL batch's recorded routes
  [Y, B, T, K] (c2/losses/rl.py)."""
  if key == "forced_routes":
    return ("layers", "batch", "length", None)
  return ("batch", "length")[:ndim]


def to_global(local_batch: dict, mesh: jax.sharding.Mesh) -> dict:
  """Per-process numpy rows -> global jax arrays sharded over the batch (and length) axes.

  This is the batch's one intended host-to-device copy, so it is allowed here explicitly: the
  training loop runs under transfer_guard("disallow"), and with several processes JAX performs
  this copy as a plain device_put the guard would otherwise refuse.
  """
  out = {}
  with jax.transfer_guard_host_to_device("allow"):
    for key in (BATCH_KEYS if set(local_batch) == set(BATCH_KEYS) else sorted(local_batch)):
      local = np.asarray(local_batch[key])
      names = batch_axis_names(key, local.ndim)
      axis = names.index("batch")
      global_shape = list(local.shape)
      global_shape[axis] *= jax.process_count()
      global_shape = tuple(global_shape)
      out[key] = jax.make_array_from_process_local_data(
          batch_sharding(mesh, global_shape, names), local, global_shape)
  return out
