"""Checkpoints: Orbax CheckpointManager over the train state, the data-iterator state and config.

Layout: workdir/ckpt/<step>/{params, opt_state, meta}. Orbax writes each step into a temporary
directory and renames it when complete, so a crash mid-save never leaves a half checkpoint that a
resume would pick up. Saves are asynchronous (training continues while arrays are written); only
the primary process writes metadata. Restores go straight into the target shardings, which may
belong to a different mesh than the one that saved.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from c2.train.state import TrainState


def _is_remote(path: str) -> bool:
  return "://" in path


class Checkpointer:
  """Save/restore of (TrainState, data iterator state, metadata) under `directory`."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    self.directory = directory if _is_remote(directory) else os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("params", "opt_state", "meta"))

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, state: TrainState, *, data_state: Optional[dict] = None,
           extra: Optional[dict] = None, force: bool = False) -> bool:
    step = int(jax.device_get(state.step))
    meta = {"step": step, "data_state": data_state, **(extra or {})}
    return self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        opt_state=ocp.args.StandardSave(state.opt_state),
        meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, abstract_state: TrainState, step: Optional[int] = None
              ) -> tuple[TrainState, dict]:
    """abstract_state: ShapeDtypeStructs carrying the target shardings."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    restored = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state.params),
        opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
        meta=ocp.args.JsonRestore()))
    meta = restored["meta"]
    state = TrainState(step=jax.device_put(jax.numpy.asarray(meta["step"], jax.numpy.int32),
                                           abstract_state.step.sharding),
                       params=restored["params"], opt_state=restored["opt_state"])
    return state, meta

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def restore_params_subset(directory: str, abstract_params: Any,
                          step: Optional[int] = None) -> tuple[dict, list[str]]:
  """Loads the params a checkpoint has and reports which of `abstract_params` it lacks.

  Used by `train.init_from`: e.g. a mid-run pretraining checkpoint without MTP modules, restored
  into a model with MTP; the missing subtrees are returned by name so the caller keeps their
  fresh initialisation. Returns (restored params for the present top-level keys, missing keys).
  Also accepted: `hf:PATH` or a Hugging Face directory (config.json + safetensors), imported
  straight into the target shardings by c2.hf.sharded (each process reads only its shards), and
  the output of `python -m c2.hf.convert import` (params/ + model_config.json).
  """
  if directory.startswith(HF_PREFIX) or _is_hf_dir(directory):
    return _import_hf(directory.removeprefix(HF_PREFIX), abstract_params)
  # Orbax reads a relative path's metadata as absent: resolve it once for both reads below.
  directory = directory if _is_remote(directory) else os.path.abspath(directory)
  if not _is_remote(directory) and os.path.exists(os.path.join(directory, "model_config.json")):
    params_dir, step = os.path.join(directory, "params"), 0  # c2.hf.convert output
  else:
    step = _init_from_step(directory, step)
    params_dir = os.path.join(directory, str(step), "params")
  # The params item on its own, read with a plain PyTree checkpointer: its metadata names the
  # saved top-level modules, and a partial restore reads only those.
  checkpointer = ocp.PyTreeCheckpointer()
  saved = checkpointer.metadata(params_dir).item_metadata.tree
  present = {k: v for k, v in abstract_params.items() if k in saved}
  missing = sorted(set(abstract_params) - set(saved))
  restored = checkpointer.restore(params_dir, args=ocp.args.PyTreeRestore(
      item=present, partial_restore=True,
      restore_args=ocp.checkpoint_utils.construct_restore_args(present)))
  logging.info("init_from %s step %d: restored %s; fresh: %s", directory, step,
               sorted(present), missing)
  return dict(restored), missing


def _init_from_step(directory: str, step: Optional[int]) -> int:
  """`step`, or the latest checkpoint step of the workdir checkpoint `directory`."""
  manager = ocp.CheckpointManager(directory, item_names=("params", "opt_state", "meta"))
  step = manager.latest_step() if step is None else step
  manager.close()
  if step is None:
    raise FileNotFoundError(f"config.train.init_from={directory!r}: no checkpoint found there")
  return step


def restore_opt_state(directory: str, abstract_opt_state: Any, step: Optional[int] = None) -> Any:
  """The optimizer state of a c2 workdir checkpoint, read into `abstract_opt_state`'s shardings
  (`train.init_from_optimizer`: a new phase continuing the previous phase's moments).

  Raises ValueError naming the problem when the checkpoint holds no optimizer state (a Hugging
  Face or converted directory) or when its state differs from this run's optimizer in structure
  or shapes (another model section, another optimizer name), rather than Orbax's tree error.
  """
  if directory.startswith(HF_PREFIX) or _is_hf_dir(directory) or (
      not _is_remote(directory) and os.path.exists(os.path.join(directory, "model_config.json"))):
    raise ValueError(f"config.train.init_from={directory!r} holds model weights only; "
                     "init_from_optimizer needs a c2 training checkpoint (workdir/ckpt)")
  directory = directory if _is_remote(directory) else os.path.abspath(directory)
  step = _init_from_step(directory, step)
  opt_dir = os.path.join(directory, str(step), "opt_state")
  checkpointer = ocp.PyTreeCheckpointer()
  try:
    saved = checkpointer.metadata(opt_dir).item_metadata.tree
  except (FileNotFoundError, ValueError) as e:
    raise ValueError(f"config.train.init_from={directory!r} step {step} has no optimizer state "
                     f"({e}); set config.train.init_from_optimizer=False") from None
  want, have = _leaf_shapes(abstract_opt_state), _leaf_shapes(saved)
  if want != have:
    diff = sorted(set(want.items()) ^ set(have.items()))[:4]
    raise ValueError(
        f"config.train.init_from={directory!r} step {step}: its optimizer state does not match "
        f"this run's ({len(have)} vs {len(want)} arrays; first differences (path, shape): "
        f"{diff}). Use the model and optim sections of the run that saved it, or set "
        "config.train.init_from_optimizer=False")
  restored = checkpointer.restore(opt_dir, args=ocp.args.PyTreeRestore(
      item=abstract_opt_state,
      restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_opt_state)))
  logging.info("init_from %s step %d: restored the optimizer state", directory, step)
  return restored


def _leaf_shapes(tree: Any) -> dict[str, tuple]:
  """{path: shape} of a pytree's arrays, with paths spelled the same for an optax state (named
  tuples, tuples) and for the nested dicts and lists Orbax's metadata holds."""
  def name(key) -> str:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        return str(getattr(key, attr))
    return str(key)
  return {"/".join(name(k) for k in path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


HF_PREFIX = "hf:"


def _is_hf_dir(directory: str) -> bool:
  return not _is_remote(directory) and os.path.exists(os.path.join(directory, "config.json")) \
      and any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json")
              for n in os.listdir(directory))


def _import_hf(hf_dir: str, abstract_params: Any) -> tuple[dict, list[str]]:
  """An HF checkpoint imported into `abstract_params`' shardings; its MTP layers beyond the
  model's depth are ignored, the model's beyond the checkpoint's returned as missing."""
  from c2.hf.sharded import import_sharded  # pylint: disable=import-outside-toplevel
  flat = {tuple(k.key for k in p): a for p, a in
          jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
  dtype = abstract_params["embed"]["embedding"].dtype
  mesh = abstract_params["embed"]["embedding"].sharding.mesh
  shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
  cfg, params = import_sharded(hf_dir, mesh, dtype=dtype, progress=jax.process_index() == 0,
                               shardings=shardings, workers=min(8, os.cpu_count() or 1))
  imported = {tuple(k.key for k in p): a for p, a in jax.tree_util.tree_flatten_with_path(
      params)[0] if p[0].key in abstract_params}
  for path, array in imported.items():
    want = flat.get(path)
    if want is None or want.shape != array.shape:
      raise ValueError(f"init_from hf:{hf_dir}: parameter {'/'.join(path)} is "
                       f"{array.shape} in the checkpoint (config {cfg}) but "
                       f"{None if want is None else want.shape} in the model config")
  present = {k: v for k, v in params.items() if k in abstract_params}
  missing = sorted(set(abstract_params) - set(present))
  logging.info("init_from hf:%s: imported %s; fresh: %s", hf_dir, sorted(present), missing)
  return present, missing
