"""xpk, local, AOT and TensorBoard launchers, by dry run; and the worker command inside xpk."""
import shlex

from launchtest import REPO_ROOT, commands

XPK = ["--cluster", "c2-gke", "--zone", "us-east5"]
EXP, WORKDIR = "experiments/pretrain.py:full", "gs://bucket/runs/Pretrain_Full"


def flag(argv, name):
    """Value of --name=VALUE in argv."""
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return value


def test_xpk_create_runs_bootstrap_then_the_worker_command(launch):
    out = launch("xpk.sh", "create", *XPK, "--type", "v5p-256", "--num-slices", "2", EXP,
                 WORKDIR, "--dry-run", "--", "--config.optim.lr=0.0003").stdout
    (argv,) = commands(out)
    assert argv[:3] == ["xpk", "workload", "create"]
    assert flag(argv, "tpu-type") == "v5p-256" and flag(argv, "num-slices") == "2"
    assert flag(argv, "cluster") == "c2-gke" and flag(argv, "zone") == "us-east5"
    assert flag(argv, "script-dir") == str(REPO_ROOT)
    assert flag(argv, "base-docker-image") == "python:3.11"
    assert shlex.split(flag(argv, "command")) == [
        "bash", "launch/bootstrap.sh", "&&", "bash", "launch/worker.sh", EXP, WORKDIR, "--",
        "--config.optim.lr=0.0003"]
    name = flag(argv, "workload")
    assert name.startswith("c2-pretrain-full-") and len(name) <= 40


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
                 "--config.optim.lr=0.1").stdout
    assert commands(out) == [["python3", "-m", "c2.main", "--config=experiments/pretrain.py:tiny",
                              "--workdir=/tmp/c2/tiny", "--config.optim.lr=0.1"]]
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


def test_tensorboard_on_the_runs_bucket(launch):
    out = launch("tensorboard.sh", "gs://bucket/runs", "--dry-run").stdout
    (argv,) = commands(out)
    assert argv[:2] == ["tensorboard", "--logdir=gs://bucket/runs"]
    out = launch("tensorboard.sh", "--dry-run", "--port", "7000", C2_RUNS="gs://b2/runs").stdout
    assert commands(out)[0][1:3] == ["--logdir=gs://b2/runs", "--port=7000"]
    assert launch("tensorboard.sh", "--dry-run", check=False).returncode != 0
