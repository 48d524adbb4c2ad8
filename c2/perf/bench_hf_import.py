"""Peak memory and throughput of the sharded HF import on a synthetic Kimi-K2.5-layout checkpoint.

  python -m c2.perf.bench_hf_import make DIR --gb 2          # writes the synthetic checkpoint
  python -m c2.perf.bench_hf_import run DIR OUT.json [--processes 2] [--single-host] [--workers N]

`make` writes a checkpoint with the release's file layout (language_model. prefix, text_config,
INT4 group-32 routed experts as weight_packed / weight_scale / weight_shape, bf16 elsewhere, an
MTP layer, 512 MB shards) of about `--gb` GB, streaming (one tensor in memory). `run` imports it
on 8 CPU devices (fsdp 2 x expert 2 x tensor 2) in bf16, in one process or in `--processes` 2
processes of 4 devices each (jax.distributed over localhost), or with the single-host importer
(`--single-host`), optionally exports the result again (`--export DIR`: all processes gather,
process 0 writes), and writes per process: VmHWM (peak RSS), bytes read / placed, the largest
device block, seconds, and a CRC32 per (leaf, device block) so runs can be compared bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zlib

import numpy as np

MESH = {"fsdp": 2, "expert": 2, "tensor": 2}


def _config(gb: float) -> dict:
  experts = max(8, int(256 * gb / 2))  # ~2 GB at 256 experts of 1024 x 768, 6 MoE-bearing layers
  return {"model_type": "kimi_k25", "text_config": {
      "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 4096,
      "moe_intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 8,
      "num_key_value_heads": 8, "n_shared_experts": 1, "n_routed_experts": experts,
      "num_experts_per_tok": 8, "routed_scaling_factor": 2.827, "kv_lora_rank": 256,
      "q_lora_rank": 384, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
      "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
      "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
      "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                              "config_groups": {"group_0": {"weights": {
                                  "num_bits": 4, "type": "int", "symmetric": True,
                                  "strategy": "group", "group_size": 32}}}}}}


def make(out_dir: str, gb: float) -> None:
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from c2 import model  # pylint: disable=import-outside-toplevel
  from c2.hf import checkpoint as hf  # pylint: disable=import-outside-toplevel
  from c2.hf import config as hf_config  # pylint: disable=import-outside-toplevel
  from c2.hf.tensors import ShardedWriter  # pylint: disable=import-outside-toplevel
  raw = _config(gb)
  cfg = hf_config.from_hf_dict(raw)
  rng = np.random.default_rng(0)
  writer = ShardedWriter(out_dir, max_shard_bytes=512 << 20)
  params = model.abstract_params(cfg)  # shapes only; each leaf's HF tensors are written in turn
  for path, _, prefixes, (name, kind), stacked in hf.leaf_plans(cfg):
    leaf = params
    for key in path:
      leaf = leaf[key]
    layer_shape = leaf.shape[1:] if stacked else leaf.shape
    for prefix in prefixes:
      prefix = "language_model." + prefix
      if kind == "experts":
        f_in = layer_shape[1]  # our [E, I, O]
        for e in range(layer_shape[0]):
          module = f"{prefix}mlp.experts.{e}.{name}"
          o = layer_shape[2]
          writer.add(module + ".weight_packed",
                     rng.integers(-2**31, 2**31, (o, f_in // 8), dtype=np.int64).astype(np.int32))
          writer.add(module + ".weight_scale",
                     (rng.random((o, f_in // 32), np.float32) * 0.01).astype(ml_dtypes.bfloat16))
          writer.add(module + ".weight_shape", np.array([o, f_in], np.int32))
      elif kind is None:
        dtype = np.float32 if name.endswith("correction_bias") else ml_dtypes.bfloat16
        writer.add(prefix + name, rng.standard_normal(layer_shape, np.float32).astype(dtype))
      else:
        o, i = hf._split(layer_shape, kind)  # pylint: disable=protected-access
        dtype = np.float32 if name == "mlp.gate" else ml_dtypes.bfloat16
        writer.add(f"{prefix}{name}.weight",
                   rng.standard_normal((o, i), np.float32).astype(dtype))
  writer.close()
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(raw, f)
  print(f"wrote {writer.total_bytes / 1e9:.2f} GB to {out_dir}")


def _proc_status_bytes(field: str) -> int:
  """A /proc/self/status memory figure in bytes: VmHWM (peak RSS) or VmRSS (now)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  return 0


def _vm_hwm() -> int:
  return _proc_status_bytes("VmHWM")


def _vm_rss() -> int:
  return _proc_status_bytes("VmRSS")


def _offline(hf_dir: str, out: str, workers: int, slice_mb: float, mesh):
  """The offline conversion (c2.hf.convert import) to OUT.c2, its memory, then the converted
  checkpoint restored on `mesh` for the CRCs of its device blocks."""
  import time  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from c2 import model  # pylint: disable=import-outside-toplevel
  from c2.hf import checkpoint as hf  # pylint: disable=import-outside-toplevel
  from c2.hf import config as hf_config  # pylint: disable=import-outside-toplevel
  from c2.hf import convert  # pylint: disable=import-outside-toplevel
  converted = out + ".c2"
  rss_before = _vm_rss()
  start = time.perf_counter()
  convert.import_hf(hf_dir, converted, "bfloat16", workers, slice_mb)
  stats = dict(convert.import_hf.stats, seconds=time.perf_counter() - start,
               peak_rss=_vm_hwm(), rss_before=rss_before)
  with open(os.path.join(converted, convert.CONFIG_FILE)) as f:
    cfg = hf_config.from_json(f.read())
  target = jax.tree_util.tree_map_with_path(  # the dtypes the import writes, on the mesh
      lambda keys, leaf, sharding: jax.ShapeDtypeStruct(
          leaf.shape, hf.import_dtype(tuple(k.key for k in keys), ml_dtypes.bfloat16),
          sharding=sharding),
      model.abstract_params(cfg), model.param_shardings(cfg, mesh))
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(os.path.join(converted, convert.PARAMS_DIR), target)
  return cfg, stats, params


def _worker(hf_dir: str, out: str, single_host: bool, workers: int, export: str | None,
            offline_slice_mb: float | None = None) -> None:
  import time  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from c2 import model  # pylint: disable=import-outside-toplevel
  from c2.hf import checkpoint as hf  # pylint: disable=import-outside-toplevel
  from c2.hf.sharded import import_sharded  # pylint: disable=import-outside-toplevel
  from c2.parallel.mesh import make_mesh  # pylint: disable=import-outside-toplevel
  if "C2_PROCESS_ID" in os.environ:
    jax.distributed.initialize(os.environ["C2_COORDINATOR"], 2, int(os.environ["C2_PROCESS_ID"]))
  mesh = make_mesh(MESH)
  baseline = _vm_hwm()
  start = time.perf_counter()
  sums, largest = {}, 0
  if single_host:
    cfg, params = hf.import_checkpoint(hf_dir, dtype=ml_dtypes.bfloat16)
    stats = {"seconds": time.perf_counter() - start}
    shardings = dict(hf._leaves(model.param_shardings(cfg, mesh)))  # pylint: disable=protected-access
    for path, leaf in hf._leaves(params):  # pylint: disable=protected-access
      for index in shardings[path].devices_indices_map(leaf.shape).values():
        block = np.ascontiguousarray(leaf[index])
        sums[f"{'/'.join(path)}{[(s.start, s.stop) for s in index]}"] = zlib.crc32(block.view(np.uint8))
        largest = max(largest, block.nbytes)
  else:
    if offline_slice_mb is not None:
      cfg, stats, params = _offline(hf_dir, out, workers, offline_slice_mb, mesh)
    else:
      cfg, params = import_sharded(hf_dir, mesh, dtype=ml_dtypes.bfloat16,
                                   progress=jax.process_index() == 0, workers=workers)
      stats = dict(import_sharded.stats)
    for path, leaf in hf._leaves(params):  # pylint: disable=protected-access
      for shard in leaf.addressable_shards:
        block = np.ascontiguousarray(np.asarray(shard.data))
        sums[f"{'/'.join(path)}{[(s.start, s.stop) for s in shard.index]}"] = zlib.crc32(block.view(np.uint8))
        largest = max(largest, block.nbytes)
  stats.setdefault("peak_rss", _vm_hwm())  # of the import (VmHWM only grows: before the export)
  if export:  # every process gathers, process 0 writes (streaming, bf16 experts)
    export_start = time.perf_counter()
    hf.export_checkpoint(cfg, params, export, dtype="bfloat16", max_shard_bytes=256 << 20)
    stats.update(export_seconds=time.perf_counter() - export_start, export_peak_rss=_vm_hwm())
  stats.update(baseline_rss=baseline, largest_block=largest,
               checkpoint_bytes=sum(os.path.getsize(os.path.join(hf_dir, n))
                                    for n in os.listdir(hf_dir) if n.endswith(".safetensors")),
               process=jax.process_index(), crc=sums)
  with open(out, "w") as f:
    json.dump(stats, f)


def run(hf_dir: str, out: str, processes: int, single_host: bool, workers: int = 1,
        export: str | None = None, offline_slice_mb: float | None = None) -> None:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "c2.perf.bench_hf_import", "_worker", hf_dir]
  flags = [f"--workers={workers}"] + (["--single-host"] if single_host else [])
  flags += [f"--export={export}"] if export else []
  flags += [f"--offline={offline_slice_mb}"] if offline_slice_mb is not None else []
  if processes == 1:
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    subprocess.run(cmd + [out] + flags, env=env, check=True)
    return
  import socket  # pylint: disable=import-outside-toplevel
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  procs = [subprocess.Popen(cmd + [f"{out}.{i}"] + flags, env=dict(
      env, C2_PROCESS_ID=str(i), C2_COORDINATOR=f"127.0.0.1:{port}")) for i in range(processes)]
  codes = [p.wait() for p in procs]
  if any(codes):
    raise SystemExit(f"workers exited with {codes}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("command", choices=("make", "run", "_worker"))
  parser.add_argument("dir")
  parser.add_argument("out", nargs="?")
  parser.add_argument("--gb", type=float, default=2.0)
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--single-host", action="store_true")
  parser.add_argument("--workers", type=int, default=1, help="threads per process")
  parser.add_argument("--export", help="then export the imported params here (HF, bf16)")
  parser.add_argument("--offline", type=float, default=None, metavar="SLICE_MB",
                      help="the offline conversion (c2.hf.convert import) to OUT.c2 with slices "
                           "of SLICE_MB, then restored on the mesh for the CRCs")
  args = parser.parse_args(argv)
  if args.command == "make":
    make(args.dir, args.gb)
  elif args.command == "run":
    run(args.dir, args.out, args.processes, args.single_host, args.workers, args.export,
        args.offline)
  else:
    _worker(args.dir, args.out, args.single_host, args.workers, args.export, args.offline)


if __name__ == "__main__":
  main()
