"""Convert between Hugging Face DeepseekV3/Kimi checkpoints and c2 params.

  python -m c2.hf.convert import HF_DIR OUT_DIR [--dtype float32|bfloat16]
  python -m c2.hf.convert export OUT_DIR HF_OUT_DIR [--dtype bfloat16|float32] [--shard-gb 5]

`import` writes OUT_DIR/params (an orbax PyTree checkpoint, a plain nested dict as `c2.model`
uses) and OUT_DIR/model_config.json (the ModelConfig). It streams slice by slice
(c2.hf.orbax_stream): each slice of a leaf (--slice-mb, default 64) is read, dequantised and
written, so memory holds --workers slices, never a leaf (the release's stacked expert projections
are 676 GB each in bf16); OUT_DIR appears only when complete (written as OUT_DIR.tmp-<pid>).
`train.init_from=OUT_DIR` starts a run from it. `export` reads those back and writes config.json,
model-0000k-of-0000n.safetensors and model.safetensors.index.json, optionally with the routed
experts re-quantised to Kimi-K2.5's INT4 group-32 format (--int4-experts). Import accepts the
quantised Kimi releases (FP8 K2, INT4 K2.5).
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import time

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from c2 import model
from c2.hf import checkpoint as hf
from c2.hf import config as hf_config
from c2.hf import orbax_stream
from c2.hf import sharded
from c2.hf.progress import progress_bar
from c2.parallel.sharding import with_shardings

PARAMS_DIR, CONFIG_FILE = "params", "model_config.json"


def import_hf(hf_dir: str, out_dir: str, dtype: str, workers: int = 1,
              slice_mb: float = 64.0) -> None:
  """HF_DIR -> OUT_DIR/params (Orbax) + model_config.json, slice by slice (c2.hf.orbax_stream):
  host memory holds `workers` slices of at most `slice_mb` MB, not a leaf, not the model."""
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir):
    raise FileExistsError(f"{out_dir} exists; convert into a new directory")
  tmp = f"{out_dir}.tmp-{os.getpid()}"
  start = time.perf_counter()
  cfg, store, root = hf.open_checkpoint(hf_dir, dtype=np_dtype)
  tree: dict = {}
  leaves = []
  for path, leaf in sharded.sliced_leaves(cfg, store, root, dtype=np_dtype,
                                          max_slice_bytes=int(slice_mb * 2**20)):
    hf.set_leaf(tree, path, leaf)
    leaves.append(leaf)
  total = sum(leaf.nbytes for leaf in leaves)
  bar = progress_bar(True, total, "import")
  os.makedirs(tmp)
  try:
    orbax_stream.save_sliced(os.path.join(tmp, PARAMS_DIR), tree, progress=bar,
                             prefetch=max(0, workers - 1))
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)  # a failed conversion leaves nothing behind
    raise
  finally:
    bar.close()
  with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
    f.write(hf_config.to_json(cfg))
  os.replace(tmp, out_dir)  # OUT_DIR appears only when complete
  seconds = time.perf_counter() - start
  import_hf.stats = {"bytes_read": store.bytes_read, "bytes_written": total, "seconds": seconds,
                     "largest_leaf": max(leaf.nbytes for leaf in leaves),
                     "largest_slice": max(leaf.slice_nbytes for leaf in leaves)}
  logging.info("imported %s: %.3fB parameters -> %s (%.2f GB read in %.1f s, %.3f GB/s)", hf_dir,
               sum(int(np.prod(leaf.shape)) for leaf in leaves) / 1e9, out_dir,
               store.bytes_read / 1e9, seconds, store.bytes_read / 1e9 / seconds)


import_hf.stats = {}


def export_hf(ckpt_dir: str, hf_out: str, dtype: str, shard_gb: float,
              int4_experts: bool = False) -> None:
  with open(os.path.join(ckpt_dir, CONFIG_FILE)) as f:
    cfg = hf_config.from_json(f.read())
  abstract = model.abstract_params(cfg)
  on_host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
  target = with_shardings(abstract, jax.tree.map(lambda _: on_host, abstract))
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(os.path.join(os.path.abspath(ckpt_dir), PARAMS_DIR), target)
  hf.export_checkpoint(cfg, params, hf_out, dtype=dtype, max_shard_bytes=int(shard_gb * 2**30),
                       progress=True, quantize_experts=int4_experts)
  logging.info("exported %s -> %s", ckpt_dir, hf_out)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  imp = sub.add_parser("import", help="HF checkpoint -> orbax params + model_config.json")
  imp.add_argument("hf_dir")
  imp.add_argument("out_dir")
  imp.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  imp.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="slices read and dequantised at once (threads; memory: this many slices)")
  imp.add_argument("--slice-mb", type=float, default=64.0,
                   help="the largest slice written at once (the zarr chunk), in MB")
  exp = sub.add_parser("export", help="orbax params + model_config.json -> HF checkpoint")
  exp.add_argument("ckpt_dir")
  exp.add_argument("hf_out")
  exp.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  exp.add_argument("--shard-gb", type=float, default=5.0)
  exp.add_argument("--int4-experts", action="store_true",
                   help="routed experts as Kimi-K2.5's INT4 group-32 (compressed-tensors)")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  if args.command == "import":
    import_hf(args.hf_dir, args.out_dir, args.dtype, args.workers, args.slice_mb)
  else:
    export_hf(args.ckpt_dir, args.hf_out, args.dtype, args.shard_gb, args.int4_experts)


if __name__ == "__main__":
  main()
