"""launch/sweep.py: get_sweep() of a small experiment file -> one run (workdir + overrides) each."""
import importlib.util
import shlex
import subprocess
import sys

import pytest
from launchtest import LAUNCH, REPO_ROOT, commands, parse_c2

_spec = importlib.util.spec_from_file_location("c2_launch_sweep", LAUNCH / "sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

EXPERIMENT = '''
import ml_collections


def get_config(arg=None):
    config = ml_collections.ConfigDict()
    config.variant = arg or "default"
    config.optim = ml_collections.ConfigDict({"lr": 1e-3, "warmup": 10})
    config.model = ml_collections.ConfigDict({"depth": 2, "name": "m"})
    return config


def get_sweep():
    return [{"optim.lr": 1e-4}, {"optim.lr": 3e-4, "model.depth": 4}, {"model.name": "a b"}]
'''


@pytest.fixture
def experiment(tmp_path):
    path = tmp_path / "fake.py"
    path.write_text(EXPERIMENT)
    return path


def test_expand(experiment):
    runs = sweep.expand(f"{experiment}:proxy", "gs://b/runs/sw/")
    assert runs == [
        ("gs://b/runs/sw/00_lr=0.0001", ["--config.optim.lr=0.0001"]),
        ("gs://b/runs/sw/01_lr=0.0003,depth=4", ["--config.optim.lr=0.0003",
                                                 "--config.model.depth=4"]),
        ("gs://b/runs/sw/02_name=a-b", ["--config.model.name=a b"]),
    ]


def test_unknown_key_fails_before_launch(experiment):
    experiment.write_text(EXPERIMENT.replace('"model.depth"', '"model.dept"'))
    with pytest.raises(SystemExit, match="model.dept"):
        sweep.expand(str(experiment), "gs://b/runs/sw")


def test_get_sweep_may_take_the_variant(experiment):
    experiment.write_text(EXPERIMENT + '''
def get_sweep(arg):
    return [{"optim.lr": 0.5 if arg == "proxy" else 0.1}]
''')
    assert sweep.expand(f"{experiment}:proxy", "w")[0][1] == ["--config.optim.lr=0.5"]
    assert sweep.expand(f"{experiment}:full", "w")[0][1] == ["--config.optim.lr=0.1"]


def test_experiment_paths_are_printed_relative_to_the_repo():
    assert sweep.repo_relative(str(REPO_ROOT / "experiments/x.py") + ":a") == "experiments/x.py:a"
    assert sweep.repo_relative("/elsewhere/x.py") == "/elsewhere/x.py"


def test_cli_prints_one_launch_per_point(experiment):
    out = subprocess.run(
        [sys.executable, str(LAUNCH / "sweep.py"), f"{experiment}:proxy", "gs://b/runs/sw",
         "--launcher", "xpk", "--", "--cluster", "c", "--zone", "z", "--type", "v5p-8"],
        capture_output=True, text=True, check=True, timeout=60).stdout
    argvs = [shlex.split(line) for line in out.splitlines()]
    assert len(argvs) == 3
    assert argvs[1] == ["launch/xpk.sh", "create", "--cluster", "c", "--zone", "z", "--type",
                        "v5p-8", f"{experiment}:proxy", "gs://b/runs/sw/01_lr=0.0003,depth=4",
                        "--", "--config.optim.lr=0.0003", "--config.model.depth=4"]


def test_cli_execute_through_a_launcher(experiment):
    """--execute runs each launcher; here local.sh in dry-run mode prints its c2.main line."""
    out = subprocess.run(
        [sys.executable, str(LAUNCH / "sweep.py"), str(experiment), "/tmp/sw", "--launcher",
         "local", "--execute", "--", "--dry-run"],
        capture_output=True, text=True, check=True, timeout=60).stdout
    trains = [argv for argv in commands(out) if argv[:3] == ["python3", "-m", "c2.main"]]
    assert [argv[3:] for argv in trains] == [
        [f"--config={experiment}", "--workdir=/tmp/sw/00_lr=0.0001", "--config.optim.lr=0.0001"],
        [f"--config={experiment}", "--workdir=/tmp/sw/01_lr=0.0003,depth=4",
         "--config.optim.lr=0.0003", "--config.model.depth=4"],
        [f"--config={experiment}", "--workdir=/tmp/sw/02_name=a-b", "--config.model.name=a b"],
    ]


def test_the_real_experiments_sweeps_launch_commands_that_parse():
    """get_sweep() of the shipped experiment files, through the local launcher: every c2.main
    command it prints parses with c2.main's parser and carries its sweep point."""
    for experiment in ("experiments/pretrain.py:tiny", "experiments/sft.py:tiny"):
        out = subprocess.run(
            [sys.executable, str(LAUNCH / "sweep.py"), experiment, "/tmp/sw", "--launcher",
             "local", "--execute", "--", "--dry-run"],
            capture_output=True, text=True, check=True, timeout=120, cwd=REPO_ROOT).stdout
        trains = [argv for argv in commands(out) if argv[:3] == ["python3", "-m", "c2.main"]]
        assert len(trains) == 3
        rates = sorted(parse_c2(argv)[0].optim.peak_lr for argv in trains)
        assert rates == [1e-3, 3e-3, 1e-2]
