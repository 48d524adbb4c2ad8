"""The README's commands stay true: every `python -m c2.main` / `c2.aot` / `c2.serve` line parses
with that module's own parser, and the modules they name exist."""
import importlib.util
import os
import pathlib
import re
import shlex

import c2.aot
import c2.eval
import c2.main
import c2.serve
from c2.perf import aot_decode

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python_m_lines():
  text = (REPO_ROOT / "README.md").read_text()
  for line in re.findall(r"^.*python -m \S+.*$", text, flags=re.M):
    words = shlex.split(line.split("#")[0].split("&&")[-1])
    if words and words[0] == "python" and words[1] == "-m":
      yield words[2], words[3:]


def test_every_module_the_readme_runs_exists():
  modules = {module for module, _ in _python_m_lines()}
  assert {"c2.main", "c2.aot", "pytest"} <= modules
  for module in modules:
    assert importlib.util.find_spec(module) is not None, module


def test_readme_train_and_aot_commands_parse(monkeypatch):
  monkeypatch.chdir(REPO_ROOT)
  parsed = {"c2.main": [], "c2.aot": [], "decode": [], "c2.serve": [], "c2.eval": []}
  for module, args in _python_m_lines():
    if module == "c2.main":
      parsed[module].append(c2.main.parse([module, *args])[0])
    elif module == "c2.aot" and "--decode" in args:
      parsed["decode"].append(aot_decode.parse_args([a for a in args if a != "--decode"]))
    elif module == "c2.perf.aot_decode":
      parsed["decode"].append(aot_decode.parse_args(args))
    elif module == "c2.aot":
      parsed[module].append(c2.aot.parse([module, *args]))
    elif module == "c2.serve":
      parsed[module].append(c2.serve.parse_args(args))
    elif module == "c2.eval":
      parsed[module].append(c2.eval.parse_args(args))
  assert [e.name for e in parsed["c2.main"]] == ["pretrain-tiny", "rl-tiny"]
  rl = parsed["c2.main"][1]
  assert rl.phase == "rl" and rl.train.init_from == "runs/sft-agentic-5/ckpt"
  topologies = [topology for _, topology in parsed["c2.aot"]]
  assert "tpu7x:8x16x16" in topologies and "v5p:16x16x16" in topologies
  two_slices = [e for e, t in parsed["c2.aot"] if e.mesh.num_slices == 2]
  assert len(two_slices) == 1 and two_slices[0].validate_for_devices(2 * 2048)["data"] == 2
  assert os.path.isfile(REPO_ROOT / "tests/perf/test_aot.py")
  assert {a.preset for a in parsed["decode"]} == {"kimi-k2.5"}
  assert [os.path.normpath(a.checkpoint) for a in parsed["c2.serve"]] == ["runs/tiny"]
  assert len(parsed["c2.eval"]) == 3
  for args in parsed["c2.eval"]:  # suite names and the environment's experiment resolve
    c2.eval.suites.parse_suites(args.suite)
    if args.env_experiment:
      assert c2.eval.cli.load_experiment(args.env_experiment).env is not None
