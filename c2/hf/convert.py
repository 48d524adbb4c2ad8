"""Convert between Hugging Face DeepseekV3/Kimi checkpoints and c2 params.

  python -m c2.hf.convert import HF_DIR OUT_DIR [--dtype float32|bfloat16]
  python -m c2.hf.convert export OUT_DIR HF_OUT_DIR [--dtype bfloat16|float32] [--shard-gb 5]

`import` writes OUT_DIR/params (an orbax PyTree checkpoint, a plain nested dict as `c2.model`
uses) and OUT_DIR/model_config.json (the ModelConfig). It streams: each leaf is imported sharded
over this host's devices (c2.hf.sharded), saved with orbax's partial save and dropped, so memory
holds one leaf, not the model; OUT_DIR appears only when complete (written as OUT_DIR.tmp-<pid>).
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

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.v1 import partial as ocp_partial

from c2 import model
from c2.hf import checkpoint as hf
from c2.hf import config as hf_config
from c2.hf import sharded
from c2.parallel.mesh import make_mesh
from c2.parallel.sharding import with_shardings

PARAMS_DIR, CONFIG_FILE = "params", "model_config.json"


def import_hf(hf_dir: str, out_dir: str, dtype: str, workers: int = 1) -> None:
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir):
    raise FileExistsError(f"{out_dir} exists; convert into a new directory")
  tmp = f"{out_dir}.tmp-{os.getpid()}"
  cfg, store, root = hf.open_checkpoint(hf_dir, dtype=np_dtype)
  mesh = make_mesh({"fsdp": -1}, jax.local_devices())
  partial_dir = os.path.join(tmp, "partial")
  n = 0
  for path, array in sharded.import_leaves(cfg, store, root, mesh, dtype=np_dtype, progress=True,
                                            workers=workers):
    tree = array
    for name in reversed(path):
      tree = {name: tree}
    ocp_partial.save(partial_dir, tree)  # adds this leaf to the checkpoint; then it is dropped
    n += array.size
    del array, tree
  ocp_partial.finalize(partial_dir)
  os.replace(os.path.join(partial_dir, "state"), os.path.join(tmp, PARAMS_DIR))
  shutil.rmtree(partial_dir)
  with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
    f.write(hf_config.to_json(cfg))
  os.replace(tmp, out_dir)
  stats = sharded.import_sharded.stats
  logging.info("imported %s: %.3fB parameters -> %s (%.2f GB read in %.1f s)", hf_dir, n / 1e9,
               out_dir, stats["bytes_read"] / 1e9, stats["seconds"])


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
  imp.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="layers read and dequantised in parallel threads")
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
    import_hf(args.hf_dir, args.out_dir, args.dtype, args.workers)
  else:
    export_hf(args.ckpt_dir, args.hf_out, args.dtype, args.shard_gb, args.int4_experts)


if __name__ == "__main__":
  main()
