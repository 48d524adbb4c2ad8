"""xpk, local, AOT and TensorBoard launchers, by dry run; and the worker command inside xpk.

Every c2 command a launcher prints goes through the real parser of `python -m c2.main` or
`python -m c2.aot` (launchtest.parse_c2): an override that is not a config field, or a topology
c2.aot cannot read, fails here instead of on a booked pod.
"""
import shlex

import pytest
from launchtest import REPO_ROOT, commands, parse_c2, worker_commands

XPK = ["--cluster", "c2-gke", "--zone", "us-east5"]
EXP, WORKDIR = "experiments/pretrain.py:full", "gs://bucket/runs/Pretrain_Full"


def flag(argv, name):
    """Value of --name=VALUE in argv."""
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return value


def test_xpk_create_runs_bootstrap_then_the_worker_command(launch, tmp_path):
    out = launch("xpk.sh", "create", *XPK, "--type", "v5p-4096", "--num-slices", "2", EXP,
                 WORKDIR, "--dry-run", "--", "--config.optim.peak_lr=0.0003",
                 "--config.mesh.data=2").stdout
    (argv,) = commands(out)
    assert argv[:3] == ["xpk", "workload", "create"]
    assert flag(argv, "tpu-type") == "v5p-4096" and flag(argv, "num-slices") == "2"
    assert flag(argv, "cluster") == "c2-gke" and flag(argv, "zone") == "us-east5"
    assert flag(argv, "script-dir") == str(REPO_ROOT)
    assert flag(argv, "base-docker-image") == "python:3.11"
    assert shlex.split(flag(argv, "command")) == [
        "bash", "launch/bootstrap.sh", "&&", "bash", "launch/worker.sh", EXP, WORKDIR, "--",
        "--config.optim.peak_lr=0.0003", "--config.mesh.data=2", "--config.mesh.num_slices=2"]
    name = flag(argv, "workload")
    assert name.startswith("c2-pretrain-full-") and len(name) <= 40
    # What every pod then runs parses, and its mesh holds 2 slices of 2048 chips (README row).
    (train, _) = worker_commands(shlex.split(flag(argv, "command")), tmp_path / "home")
    exp, values = parse_c2(train)
    assert values["workdir"].value == WORKDIR and exp.optim.peak_lr == 0.0003
    assert exp.mesh.num_slices == 2
    assert exp.validate_for_devices(2 * 2048)["data"] == 2


def test_xpk_multislice_without_a_data_axis_is_refused_before_launch(launch, tmp_path):
    """--num-slices 2 on the full experiment (data=1): the config check names the fix."""
    from c2.config import ConfigError  # pylint: disable=import-outside-toplevel
    out = launch("xpk.sh", "create", *XPK, "--type", "v5p-4096", "--num-slices", "2", EXP,
                 WORKDIR, "--dry-run").stdout
    (train, _) = worker_commands(shlex.split(flag(commands(out)[0], "command")),
                                 tmp_path / "home")
    exp, _ = parse_c2(train)
    with pytest.raises(ConfigError, match="config.mesh.data"):
        exp.validate_for_devices(2 * 2048)


def test_xpk_delete_finds_the_workload_create_made(launch):
    create = commands(launch("xpk.sh", "create", *XPK, "--type", "v5p-8", EXP, WORKDIR,
                             "--dry-run").stdout)[0]
    delete = commands(launch("xpk.sh", "delete", *XPK, WORKDIR, "--dry-run").stdout)[0]
    assert delete[:3] == ["xpk", "workload", "delete"] and "--force" in delete
    assert flag(delete, "workload") == flag(create, "workload")
    other = commands(launch("xpk.sh", "delete", *XPK, "gs://b/other/Pretrain_Full",
                            "--dry-run").stdout)[0]
    assert flag(other, "workload") != flag(create, "workload")   # same basename, other run
    listing = commands(launch("xpk.sh", "list", *XPK, "--dry-run").stdout)[0]
    assert listing[:3] == ["xpk", "workload", "list"]


def test_local(launch):
    out = launch("local.sh", "experiments/pretrain.py:tiny", "/tmp/c2/tiny", "--dry-run", "--",
                 "--config.optim.peak_lr=0.1").stdout
    assert commands(out) == [["python3", "-m", "c2.main", "--config=experiments/pretrain.py:tiny",
                              "--workdir=/tmp/c2/tiny", "--config.optim.peak_lr=0.1"]]
    exp, values = parse_c2(commands(out)[0])
    assert exp.optim.peak_lr == 0.1 and values["workdir"].value == "/tmp/c2/tiny"
    out = launch("local.sh", "--cpu-devices", "8", "e.py:tiny", "/w", "--dry-run",
                 XLA_FLAGS="--xla_dump_to=/d").stdout   # kept, with the device count added
    assert commands(out)[0][:3] == ["env", "JAX_PLATFORMS=cpu",
                                    "XLA_FLAGS=--xla_dump_to=/d "
                                    "--xla_force_host_platform_device_count=8"]


def test_aot(launch):
    out = launch("aot.sh", EXP, "v5p-256", "--dry-run", "--", "--config.mesh.expert=8").stdout
    assert commands(out) == [["env", "JAX_PLATFORMS=cpu", "TPU_SKIP_MDS_QUERY=1", "python3",
                              "-m", "c2.aot", f"--config={EXP}", "--topology=v5p-256",
                              "--config.mesh.expert=8"]]
    exp, topology = parse_c2(commands(out)[0])
    assert topology == "v5p:4x4x8" and exp.mesh.expert == 8   # 128 chips
    assert exp.validate_for_devices(128)["fsdp"] == 128 // (8 * 4)


@pytest.mark.parametrize("args,message", [
    (["--", "--config.optim.lr=1e-4"], "lr"),       # not a field: it is optim.peak_lr
    (["--", "--num-slices=2x"], "num"),
])
def test_aot_commands_that_would_fail_on_the_host_fail_here(launch, args, message):
    from absl import flags  # pylint: disable=import-outside-toplevel
    out = launch("aot.sh", EXP, "v5p-256", "--dry-run", *args).stdout
    with pytest.raises((flags.Error, KeyError, AttributeError, ValueError), match=message):
        parse_c2(commands(out)[0])


@pytest.mark.parametrize("accelerator,topology", [
    ("v5p-256", "v5p:4x4x8"), ("v6e-64", "v6e:8x8"), ("tpu7x-128", "tpu7x:4x4x4"),
    ("v5p:16x16x16", "v5p:16x16x16")])
def test_aot_takes_the_accelerator_types_users_type(launch, accelerator, topology):
    out = launch("aot.sh", "experiments/pretrain.py:tiny", accelerator, "--dry-run").stdout
    assert parse_c2(commands(out)[0])[1] == topology


def test_tensorboard_on_the_runs_bucket(launch):
    out = launch("tensorboard.sh", "gs://bucket/runs", "--dry-run").stdout
    (argv,) = commands(out)
    assert argv[:2] == ["tensorboard", "--logdir=gs://bucket/runs"]
    out = launch("tensorboard.sh", "--dry-run", "--port", "7000", C2_RUNS="gs://b2/runs").stdout
    assert commands(out)[0][1:3] == ["--logdir=gs://b2/runs", "--port=7000"]
    assert launch("tensorboard.sh", "--dry-run", check=False).returncode != 0
