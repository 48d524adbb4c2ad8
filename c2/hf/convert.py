"""Convert between Hugging Face DeepseekV3/Kimi checkpoints and c2 params.

  python -m c2.hf.convert import HF_DIR OUT_DIR [--dtype float32|bfloat16]
  python -m c2.hf.convert export OUT_DIR HF_OUT_DIR [--dtype bfloat16|float32] [--shard-gb 5]

`import` writes OUT_DIR/params (orbax StandardCheckpointer, a plain nested dict as `c2.model`
uses) and OUT_DIR/model_config.json (the ModelConfig). `export` reads those back and writes
config.json, model-0000k-of-0000n.safetensors and model.safetensors.index.json. Both accept the
quantised Kimi releases on import (FP8 K2, INT4 K2.5) and export unquantised weights.
"""
from __future__ import annotations

import argparse
import logging
import os

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from c2 import model
from c2.hf import checkpoint as hf
from c2.hf import config as hf_config
from c2.parallel.sharding import with_shardings

PARAMS_DIR, CONFIG_FILE = "params", "model_config.json"


def import_hf(hf_dir: str, out_dir: str, dtype: str) -> None:
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
  cfg, params = hf.import_checkpoint(hf_dir, dtype=np_dtype, progress=True)
  os.makedirs(out_dir, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(os.path.abspath(out_dir), PARAMS_DIR), params)
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    f.write(hf_config.to_json(cfg))
  n = sum(x.size for x in jax.tree.leaves(params))
  logging.info("imported %s: %.3fB parameters -> %s", hf_dir, n / 1e9, out_dir)


def export_hf(ckpt_dir: str, hf_out: str, dtype: str, shard_gb: float) -> None:
  with open(os.path.join(ckpt_dir, CONFIG_FILE)) as f:
    cfg = hf_config.from_json(f.read())
  abstract = model.abstract_params(cfg)
  on_host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
  target = with_shardings(abstract, jax.tree.map(lambda _: on_host, abstract))
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(os.path.join(os.path.abspath(ckpt_dir), PARAMS_DIR), target)
  hf.export_checkpoint(cfg, params, hf_out, dtype=dtype, max_shard_bytes=int(shard_gb * 2**30),
                       progress=True)
  logging.info("exported %s -> %s", ckpt_dir, hf_out)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  imp = sub.add_parser("import", help="HF checkpoint -> orbax params + model_config.json")
  imp.add_argument("hf_dir")
  imp.add_argument("out_dir")
  imp.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  exp = sub.add_parser("export", help="orbax params + model_config.json -> HF checkpoint")
  exp.add_argument("ckpt_dir")
  exp.add_argument("hf_out")
  exp.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  exp.add_argument("--shard-gb", type=float, default=5.0)
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  if args.command == "import":
    import_hf(args.hf_dir, args.out_dir, args.dtype)
  else:
    export_hf(args.ckpt_dir, args.hf_out, args.dtype, args.shard_gb)


if __name__ == "__main__":
  main()
