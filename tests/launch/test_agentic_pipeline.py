"""launch/agentic_pipeline.sh by dry run: the phases in order, each run from the last one's
checkpoint, and every c2.main command through c2.main's own parser."""
import subprocess
import sys

from launchtest import REPO_ROOT, commands, parse_c2


def _modules(argv):
  return argv[argv.index("-m") + 1]


def test_five_sft_rounds_chain_and_the_last_three_use_recovery_data_of_seeds_0_1_2(launch):
  out = launch("agentic_pipeline.sh", "--dry-run", "--", "--config.train.steps=7").stdout
  argvs = commands(out)
  assert [_modules(a) for a in argvs] == ["c2.main", "c2.envs.transcripts"] + ["c2.main"] * 5 + [
      "c2.envs.transcripts", "c2.main"] * 3 + ["c2.main"]
  runs = {}
  for argv in argvs:
    if _modules(argv) == "c2.main":
      exp, values = parse_c2(argv)
      runs[values["workdir"].value] = (exp, argv)
  assert list(runs) == ["runs/tiny", "runs/copy-drills", "runs/copy-128", "runs/copy-512",
                        "runs/sft-agentic", "runs/sft-agentic-2", "runs/sft-agentic-3",
                        "runs/sft-agentic-4", "runs/sft-agentic-5", "runs/rl-tiny"]
  workdirs = list(runs)
  for previous, workdir in zip(workdirs, workdirs[1:]):
    exp, _ = runs[workdir]
    assert exp.train.init_from == f"{previous}/ckpt", workdir
    assert exp.data.tokenizer == "runs/tiny/tokenizer.json"
  assert runs["runs/sft-agentic-2"][0].data.source == "jsonl:runs/agentic-data/{split}-*.jsonl"
  slip_dirs = {"runs/sft-agentic-3": "runs/agentic-slip",
               "runs/sft-agentic-4": "runs/agentic-slip-s1",
               "runs/sft-agentic-5": "runs/agentic-slip-s2"}
  for workdir, slip_dir in slip_dirs.items():
    assert runs[workdir][0].data.source == f"jsonl:{slip_dir}/{{split}}-*.jsonl"
    assert runs[workdir][0].train.steps == 140
  assert runs["runs/rl-tiny"][0].train.steps == 7   # the overrides reach the RL run only
  slips = [a for a in argvs if "--slip-fraction" in a]
  assert [(s[s.index("--out") + 1], s[s.index("--seed") + 1], s[s.index("--slip-fraction") + 1])
          for s in slips] == [(d, str(seed), "0.5") for seed, d in enumerate(slip_dirs.values())]
  # Every transcripts flag the script passes is one the module accepts.
  usage = subprocess.run([sys.executable, "-m", "c2.envs.transcripts", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout
  for argv in (argvs[1], *slips):
    for word in argv:
      if word.startswith("--"):
        assert word in usage, word


def test_three_sft_rounds_are_two_on_the_oracle_data_and_one_on_recovery_data(launch):
  argvs = commands(launch("agentic_pipeline.sh", "--sft-rounds", "3", "--dry-run").stdout)
  slips = [a for a in argvs if "--slip-fraction" in a]
  assert len(slips) == 1 and slips[0][slips[0].index("--seed") + 1] == "0"
  exp, values = parse_c2(argvs[-1])
  assert exp.train.init_from == "runs/sft-agentic-3/ckpt"


def test_two_sft_rounds_put_the_recovery_data_in_the_second(launch):
  argvs = commands(launch("agentic_pipeline.sh", "--sft-rounds", "2", "--dry-run").stdout)
  exp, values = parse_c2(argvs[-2])
  assert values["workdir"].value == "runs/sft-agentic-2"
  assert exp.data.source == "jsonl:runs/agentic-slip/{split}-*.jsonl"


def test_one_sft_round_uses_the_oracle_transcripts_only(launch):
  argvs = commands(launch("agentic_pipeline.sh", "--sft-rounds", "1", "--dry-run").stdout)
  assert not any("--slip-fraction" in a for a in argvs)
  exp, values = parse_c2(argvs[-1])
  assert values["workdir"].value == "runs/rl-tiny"
  assert exp.train.init_from == "runs/sft-agentic/ckpt"


def test_bad_round_count_names_the_flag(launch):
  proc = launch("agentic_pipeline.sh", "--sft-rounds", "0", "--dry-run", check=False)
  assert proc.returncode != 0 and "--sft-rounds" in proc.stderr
