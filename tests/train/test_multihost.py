"""Two processes on localhost (CPU collectives over gloo) train exactly like one process."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

SMALL_OVERRIDES = [
    "--config.model.num_layers=2", "--config.model.hidden_size=64",
    "--config.model.dense_ffn_size=128", "--config.model.moe_ffn_size=32",
    "--config.model.q_lora_rank=32", "--config.model.kv_lora_rank=32",
    "--config.model.qk_nope_head_dim=16", "--config.model.qk_rope_head_dim=8",
    "--config.model.v_head_dim=16", "--config.model.vocab_size=512",
    "--config.model.dtype=float32",
    "--config.data.seq_len=64", "--config.data.global_batch_size=4",
    "--config.data.tokenizer_vocab_size=512", "--config.optim.warmup_steps=1",
    "--config.train.steps=3", "--config.train.log_every=1", "--config.train.eval_every=3",
    "--config.train.eval_batches=1", "--config.train.max_minutes=10",
    "--config.checkpoint.every_steps=3",
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices_per_process: int) -> dict:
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
  return env


def _losses(workdir) -> dict[int, float]:
  out = {}
  for line in open(os.path.join(workdir, "tb", "metrics.jsonl")):
    record = json.loads(line)
    if "train/loss" in record:
      out[record["step"]] = record["train/loss"]
  return out


@pytest.mark.slow
def test_two_processes_match_one(tokenizer_512, tmp_path):
  command = [sys.executable, "-m", "c2.main", "--config", "experiments/pretrain.py:tiny"]
  command += SMALL_OVERRIDES
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  workdirs = {}
  for name in ("one", "two"):
    workdirs[name] = tmp_path / name
    workdirs[name].mkdir()
    shutil.copy(tokenizer_512, workdirs[name] / "tokenizer.json")

  single = subprocess.run(command + [f"--workdir={workdirs['one']}"], cwd=repo, env=_env(2),
                          capture_output=True, text=True, timeout=600)
  assert single.returncode == 0, single.stderr[-3000:]

  port = _free_port()
  procs = [subprocess.Popen(
      command + [f"--workdir={workdirs['two']}", f"--coordinator_address=127.0.0.1:{port}",
                 "--num_processes=2", f"--process_id={i}"],
      cwd=repo, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  try:
    outputs = [p.communicate(timeout=600) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, (_, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]

  one, two = _losses(workdirs["one"]), _losses(workdirs["two"])
  assert sorted(one) == sorted(two) == [1, 2, 3]
  for step in one:
    assert two[step] == pytest.approx(one[step], rel=1e-5), (step, one, two)
