"""train.eval_suites: the suites run inside training on the step's params, and the evaluation
command reads the same run's checkpoints; a later checkpoint scores better (slow: it trains)."""
import json

import pytest

from c2 import config as config_lib
from c2.train import loop as train


def test_eval_suites_are_validated(small_experiment):
  build, _ = small_experiment
  with pytest.raises(config_lib.ConfigError, match="config.train.eval_suites='codebse'"):
    build(**{"train.eval_suites": "codebse"})
  with pytest.raises(config_lib.ConfigError, match="eval_suites_every"):
    build(**{"train.eval_suites_every": -1})


@pytest.mark.slow
def test_suites_in_training_and_from_the_command_line(small_experiment, tmp_path, capsys):
  build, seed_dir = small_experiment
  exp = build(**{"train.eval_suites": "codebase,knowledge", "train.steps": 8,
                 "train.eval_every": 4, "checkpoint.every_steps": 4})
  workdir = seed_dir(tmp_path / "run")
  train.run(exp, workdir)
  logged = [json.loads(l) for l in open(f"{workdir}/tb/metrics.jsonl")]
  nats = {r["step"]: r["eval/codebase/nats_per_byte"] for r in logged
          if "eval/codebase/nats_per_byte" in r}
  assert sorted(nats) == [4, 8] and nats[8] < nats[4]  # the later step compresses better
  results = json.loads(open(f"{workdir}/evals/results.json").read())
  assert set(results) == {"step 4", "step 8"}
  assert (tmp_path / "run" / "evals" / "plots" / "base_probes.png").exists()

  from c2 import eval as eval_cli
  out = tmp_path / "out"
  eval_cli.main(["--checkpoint", workdir, "--steps", "all", "--suite", "codebase",
                 "--codebase-bytes", "4000", "--out", str(out)])
  printed = capsys.readouterr().out
  assert "eval/codebase/nats_per_byte" in printed and f"figure:      {out}/plots" in printed
  cli = json.loads((out / "results.json").read_text())
  assert set(cli) == {"run@4", "run@8"}
  assert (cli["run@8"]["metrics"]["eval/codebase/nats_per_byte"]
          < cli["run@4"]["metrics"]["eval/codebase/nats_per_byte"])
  assert (out / "plots" / "base_probes.svg").exists() and list((out / "tb").iterdir())


def test_positions_from_takes_another_runs_rope_settings(tmp_path):
  """c2.eval --positions-from WORKDIR: a checkpoint scored under the RoPE range and YaRN of a
  long-context run (its step 0 as that run sees it); the rest of the model stays its own."""
  import dataclasses  # pylint: disable=import-outside-toplevel

  from c2 import eval as eval_cli  # pylint: disable=import-outside-toplevel
  from c2.cli import load_experiment  # pylint: disable=import-outside-toplevel
  extension = config_lib.from_config_dict(load_experiment("experiments/extend_256k.py:tiny"))
  (tmp_path / "ext" / "tb").mkdir(parents=True)
  (tmp_path / "ext" / "tb" / "config.json").write_text(json.dumps(dataclasses.asdict(extension)))
  start = config_lib.from_config_dict(load_experiment("experiments/pretrain.py:tiny")).model
  assert start.rope_scaling != extension.model.rope_scaling
  with_positions_of = eval_cli._with_positions_of  # pylint: disable=protected-access
  seen = with_positions_of(start, str(tmp_path / "ext"))
  assert seen.rope_scaling == extension.model.rope_scaling
  assert seen.max_position_embeddings == 2048 and seen.hidden_size == start.hidden_size
  assert seen.replace(rope_scaling=start.rope_scaling,
                      max_position_embeddings=start.max_position_embeddings) == start
  with pytest.raises(SystemExit, match="no tb/config.json"):
    with_positions_of(start, str(tmp_path))
