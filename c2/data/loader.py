"""Trainer-facing glue: the phase's iterator from plain settings, and host batches -> global arrays.

Each process reads only its slice of the data ([B / process_count, T] rows); the global batch is
assembled without any host holding all of it (`jax.make_array_from_process_local_data`).
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.sharding import NamedSharding

from c2 import sharding
from c2.data import pipeline
from c2.data.tokenizer import Tokenizer

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


def make_iterator(*, phase: str, source: str, tokenizer: Tokenizer, seq_len: int,
                  global_batch_size: int, seed: int, split: str,
                  num_epochs: Optional[int] = None, text_field: str = "text",
                  sft_train_on: str = "current_turn", read_threads: int = 1,
                  num_workers: int = 0):
  """The checkpointable iterator of this process's [B_local, T] batches for a phase."""
  process_count = jax.process_count()
  if global_batch_size % process_count:
    raise ValueError(f"config.data.global_batch_size={global_batch_size} is not divisible by the "
                     f"{process_count} processes")
  common = dict(source_spec=source, tokenizer=tokenizer, seq_len=seq_len,
                batch_size=global_batch_size // process_count, seed=seed,
                process_index=jax.process_index(), process_count=process_count, split=split,
                num_epochs=num_epochs, read_threads=read_threads, num_workers=num_workers)
  if phase == "sft":
    return pipeline.make_sft_iterator(train_on=sft_train_on, **common)
  return pipeline.make_lm_iterator(text_field=text_field, **common)


def batch_sharding(mesh: jax.sharding.Mesh, global_shape: tuple[int, int]) -> NamedSharding:
  spec = sharding.logical_to_spec(("batch", "length"), global_shape, dict(mesh.shape))
  return NamedSharding(mesh, spec)


def to_global(local_batch: dict, mesh: jax.sharding.Mesh) -> dict:
  """Per-process numpy rows -> global jax arrays sharded over the batch (and length) axes."""
  out = {}
  for key in BATCH_KEYS:
    local = np.asarray(local_batch[key])
    global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    out[key] = jax.make_array_from_process_local_data(batch_sharding(mesh, global_shape), local,
                                                      global_shape)
  return out
