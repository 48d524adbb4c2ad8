"""Crash and preemption, end to end: `python -m c2.main` killed mid-run, then the same command again.

SIGKILL (a crash): the rerun resumes from the newest finished checkpoint and retrains only the
steps after it (the lost window), replaying them exactly. SIGTERM (a preemption): the run saves
the step it reached, exits 0, and the rerun continues from that very step.

Each run is a subprocess of experiments/pretrain.py:tiny shrunk to the test model (2 fake CPU
devices, so restore goes into sharded arrays). The runs of this module share a persistent JAX
compilation cache, so only the first one pays for compiling the train step.
"""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 24
CHECKPOINT_EVERY = 2
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
SIGTERM_SAVED = re.compile(r"SIGTERM: saved step (\d+), exiting")


@pytest.fixture(scope="module")
def command_and_env(small_cfg, tmp_path_factory):
  """The launch command's shrinking overrides and a subprocess environment."""
  from c2.model.config import get_preset
  tiny = get_preset("tiny")
  # The test model as flags: every field where the `small_cfg` fixture differs from the preset.
  model_flags = [f"--config.model.{f.name}={getattr(small_cfg, f.name)}"
                 for f in dataclasses.fields(small_cfg)
                 if getattr(small_cfg, f.name) != getattr(tiny, f.name)]
  overrides = model_flags + [
      "--config.data.seq_len=64", "--config.data.global_batch_size=8",
      "--config.data.tokenizer_vocab_size=512", "--config.optim.warmup_steps=2",
      f"--config.train.steps={STEPS}",
      "--config.train.log_every=1", "--config.train.eval_every=1000",
      "--config.train.eval_batches=1", "--config.train.ce_chunk_size=256",
      f"--config.checkpoint.every_steps={CHECKPOINT_EVERY}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")))
  return overrides, env


class Run:
  """One `python -m c2.main` subprocess writing its stdout and stderr to a log file."""

  def __init__(self, workdir, overrides, env, name):
    self.log_path = workdir.parent / f"{workdir.name}.{name}.log"
    self._log = open(self.log_path, "w")
    self.process = subprocess.Popen(
        [sys.executable, "-m", "c2.main", "--config", "experiments/pretrain.py:tiny",
         "--workdir", str(workdir), *overrides],
        cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

  def output(self) -> str:
    return self.log_path.read_text(errors="replace")

  def wait_for(self, condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
      if condition():
        return
      if self.process.poll() is not None:
        pytest.fail(f"the run exited ({self.process.returncode}) before {what}:\n"
                    f"{self.output()[-3000:]}")
      time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}:\n{self.output()[-3000:]}")

  def wait(self, timeout: float) -> int:
    try:
      return self.process.wait(timeout)
    except subprocess.TimeoutExpired:
      pytest.fail(f"the run did not finish within {timeout} s:\n{self.output()[-3000:]}")

  def close(self):
    if self.process.poll() is None:
      self.process.kill()
      self.process.wait()
    self._log.close()


def _finished_steps(workdir) -> list[int]:
  """Steps of complete checkpoints: Orbax writes `<step>.orbax-checkpoint-tmp-*` then renames."""
  ckpt = workdir / "ckpt"
  return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


def _train_losses(lines) -> list[tuple[int, float]]:
  rows = [json.loads(line) for line in lines]
  return [(row["step"], row["train/loss"]) for row in rows if "train/loss" in row]


def _metric_lines(workdir) -> list[str]:
  path = workdir / "tb" / "metrics.jsonl"
  return path.read_text().splitlines() if path.exists() else []


def _seeded_workdir(tmp_path, tokenizer_512):
  workdir = tmp_path / "run"
  workdir.mkdir()
  shutil.copy(tokenizer_512, workdir / "tokenizer.json")  # no tokenizer training in the runs
  return workdir


def test_sigkill_then_rerun_resumes_from_the_last_checkpoint(command_and_env, tokenizer_512,
                                                            tmp_path):
  overrides, env = command_and_env
  workdir = _seeded_workdir(tmp_path, tokenizer_512)
  first = Run(workdir, overrides, env, "first")
  try:
    # Kill once a checkpoint is complete and at least one step after it has been logged, so
    # the lost window (steps trained after the checkpoint) is not empty.
    def checkpoint_and_a_step_beyond():
      finished, logged = _finished_steps(workdir), _train_losses(_metric_lines(workdir))
      return finished and logged and logged[-1][0] > finished[-1]
    first.wait_for(checkpoint_and_a_step_beyond, timeout=600, what="a checkpoint")
    first.process.send_signal(signal.SIGKILL)
    assert first.wait(60) == -signal.SIGKILL
  finally:
    first.close()
  before = _metric_lines(workdir)
  lost_until = _train_losses(before)[-1][0]
  resume_step = _finished_steps(workdir)[-1]
  assert resume_step % CHECKPOINT_EVERY == 0 and resume_step < lost_until < STEPS

  second = Run(workdir, overrides, env, "second")
  try:
    assert second.wait(600) == 0, second.output()[-3000:]
    output = second.output()
  finally:
    second.close()
  match = RESUMED.search(output)
  assert match, output[-3000:]
  assert match.group(1) == str(workdir / "ckpt") and int(match.group(2)) == resume_step
  assert "held-out unigram entropy" not in output  # a resumed run does not start over

  first_losses = _train_losses(before)
  second_losses = _train_losses(_metric_lines(workdir)[len(before):])
  assert [s for s, _ in first_losses] == list(range(1, lost_until + 1))
  # Every step after the checkpoint exactly once in the rerun, so only the lost window
  # (resume_step, lost_until] was trained twice ...
  assert [s for s, _ in second_losses] == list(range(resume_step + 1, STEPS + 1))
  # ... and identically: same restored weights, optimizer state and data-iterator position.
  replayed = dict(second_losses)
  for step, loss in first_losses[resume_step:]:
    assert replayed[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), step
  assert _finished_steps(workdir)[-1] == STEPS


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_rerun_continues(command_and_env, tokenizer_512,
                                                           tmp_path):
  overrides, env = command_and_env
  workdir = _seeded_workdir(tmp_path, tokenizer_512)
  first = Run(workdir, overrides, env, "first")
  try:
    # The first logged step proves the loop (and its SIGTERM handler) is running.
    first.wait_for(lambda: len(_train_losses(_metric_lines(workdir))) >= 3, timeout=600,
                   what="training steps")
    first.process.send_signal(signal.SIGTERM)
    assert first.wait(300) == 0, first.output()[-3000:]
    output = first.output()
  finally:
    first.close()
  match = SIGTERM_SAVED.search(output)
  assert match, output[-3000:]
  saved = int(match.group(1))
  assert 3 <= saved < STEPS and _finished_steps(workdir)[-1] == saved
  before = _metric_lines(workdir)
  assert [s for s, _ in _train_losses(before)] == list(range(1, saved + 1))

  second = Run(workdir, overrides, env, "second")
  try:
    assert second.wait(600) == 0, second.output()[-3000:]
    output = second.output()
  finally:
    second.close()
  match = RESUMED.search(output)
  assert match and int(match.group(2)) == saved, output[-3000:]
  # Nothing is lost on a preemption: the rerun trains exactly the remaining steps.
  resumed = _train_losses(_metric_lines(workdir)[len(before):])
  assert [s for s, _ in resumed] == list(range(saved + 1, STEPS + 1))
