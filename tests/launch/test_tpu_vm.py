"""TPU VM path: tpu.sh (create/delete), setup.sh + bootstrap.sh, run.sh + worker.sh.

Mostly dry runs; create and worker.sh also run for real against a fake gcloud / python.
"""
import shlex
import shutil

import pytest
from launchtest import REPO_ROOT, commands, parse_c2, remote_command, worker_commands

TPU = ["--tpu", "c2-v5p", "--zone", "us-east5-a"]
EXP, WORKDIR = "experiments/pretrain.py:proxy", "gs://bucket/runs/pt_proxy"


def fake_gcloud(tmp_path, describe_rc):
    """A stand-in for gcloud on PATH: logs each call's argv, `describe` exits describe_rc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "gcloud"
    tool.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\n'
                    f'case "$*" in *describe*) exit {describe_rc};; esac\n')
    tool.chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"



def test_create_tpu_vm(launch):
    out = launch("tpu.sh", "create", *TPU, "--type", "v5p-128", "--dry-run").stdout
    assert "# dry run: assuming tpu-vm c2-v5p is absent" in out   # a real run checks first
    assert commands(out) == [[
        "gcloud", "compute", "tpus", "tpu-vm", "create", "c2-v5p", "--accelerator-type=v5p-128",
        "--version=v2-alpha-tpuv5", "--zone=us-east5-a"]]


def test_create_queued_resource(launch):
    out = launch("tpu.sh", "create", *TPU, "--type", "v6e-256", "--queued", "--spot",
                 "--project", "proj", "--dry-run").stdout
    assert commands(out) == [[
        "gcloud", "compute", "tpus", "queued-resources", "create", "c2-v5p", "--node-id=c2-v5p",
        "--accelerator-type=v6e-256", "--runtime-version=v2-alpha-tpuv6e", "--spot",
        "--zone=us-east5-a", "--project=proj"]]


@pytest.mark.parametrize("tpu_type,runtime", [
    ("v4-32", "tpu-ubuntu2204-base"), ("v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("tpu7x-128", "v2-alpha-tpu7-ubuntu2404")])
def test_runtime_follows_type_unless_overridden(launch, tpu_type, runtime):
    out = launch("tpu.sh", "create", *TPU, "--type", tpu_type, "--dry-run").stdout
    assert f"--version={runtime}" in commands(out)[0]
    out = launch("tpu.sh", "create", *TPU, "--type", tpu_type, "--dry-run", C2_RUNTIME="rt").stdout
    assert "--version=rt" in commands(out)[0]


def test_delete(launch):
    out = launch("tpu.sh", "delete", *TPU, "--queued", "--dry-run").stdout
    assert commands(out) == [["gcloud", "compute", "tpus", "queued-resources", "delete", "c2-v5p",
                              "--force", "--quiet", "--zone=us-east5-a"]]
    out = launch("tpu.sh", "delete", *TPU, "--dry-run").stdout
    assert commands(out)[0][:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "c2-v5p"]


def test_ssh_and_stop_reach_all_workers(launch):
    ssh = commands(launch("tpu.sh", "ssh", *TPU, "--dry-run", "--", "tail", "c2-logs/x").stdout)
    assert ssh == [["gcloud", "compute", "tpus", "tpu-vm", "ssh", "c2-v5p", "--worker=all",
                    "--command", "tail c2-logs/x", "--zone=us-east5-a"]]
    stop = commands(launch("tpu.sh", "stop", *TPU, "--dry-run").stdout)[0]
    assert "--worker=all" in stop and "pkill -TERM" in remote_command(stop)


def test_missing_or_unknown_flags_fail_with_a_hint(launch):
    proc = launch("tpu.sh", "create", *TPU, "--dry-run", check=False)
    assert proc.returncode != 0 and "missing --type" in proc.stderr
    proc = launch("run.sh", "--tpu", "x", "--zne", "z", EXP, WORKDIR, check=False)
    assert proc.returncode != 0 and "unknown flag --zne" in proc.stderr
    proc = launch("run.sh", *TPU, EXP, "--dry-run", check=False)
    assert proc.returncode != 0 and "EXPERIMENT WORKDIR" in proc.stderr


def test_run_stops_syncs_bootstraps_then_trains_everywhere(launch, tmp_path):
    out = launch("run.sh", *TPU, EXP, WORKDIR, "--dry-run", "--", "--config.optim.peak_lr=0.001",
                 "--config.name=a b").stdout
    stop, tar, scp, unpack, bootstrap, train = commands(out)
    assert "pkill" in remote_command(stop)
    assert tar[:2] == ["tar", "-czf"] and tar[-3:] == ["-C", str(REPO_ROOT), "."]
    assert "--exclude-vcs" in tar and scp[5] == tar[2]   # the tarball that was just made
    assert scp[3:5] == ["tpu-vm", "scp"] and "--worker=all" in scp
    assert "mv c2.new c2" in remote_command(unpack)
    assert remote_command(bootstrap) == "bash c2/launch/bootstrap.sh"
    assert train[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "c2-v5p", "--worker=all"]
    assert shlex.split(remote_command(train)) == [
        "cd", "c2", "&&", "bash", "launch/worker.sh", EXP, WORKDIR, "--",
        "--config.optim.peak_lr=0.001", "--config.name=a b"]
    # What each worker then runs parses with c2.main's own parser.
    (worker_train, _) = worker_commands(shlex.split(remote_command(train)), tmp_path / "home")
    exp, values = parse_c2(worker_train)
    assert exp.optim.peak_lr == 0.001 and exp.name == "a b" and values["workdir"].value == WORKDIR


def test_worker_runs_c2_main_and_keeps_a_log_per_host(launch):
    """What each worker then executes: the one training command, its log copied to WORKDIR."""
    out = launch("worker.sh", EXP, WORKDIR + "/", "--", "--config.optim.peak_lr=0.001",
                 C2_DRY_RUN="1").stdout
    (train, cp) = commands(out)
    assert train[:6] == ["python3", "-m", "c2.main", f"--config={EXP}", f"--workdir={WORKDIR}",
                         "--config.optim.peak_lr=0.001"]
    assert parse_c2(train)[0].optim.peak_lr == 0.001
    assert train[6:9] == ["2>&1", "|", "tee"] and train[-1].endswith(".log")
    assert cp[:3] == ["gcloud", "storage", "cp"] and cp[3] == train[-1]
    assert cp[4].startswith(WORKDIR + "/logs/") and cp[4].endswith(".log")


def test_run_detached_without_setup(launch):
    out = launch("run.sh", *TPU, "--no-setup", "--detach", EXP, WORKDIR, "--dry-run").stdout
    stop, train = commands(out)   # no tar/scp/bootstrap
    cmd = remote_command(train)
    assert cmd.startswith("cd c2 && setsid nohup bash launch/worker.sh") and cmd.endswith("&")
    worker = shlex.split(cmd)
    worker = worker[:worker.index(">/dev/null")]   # the detaching redirections are the shell's
    (worker_train, _) = worker_commands(worker, launch.keywords["home"])
    assert parse_c2(worker_train)[0].phase == "pretrain"


def test_setup_can_clone_instead_of_copy(launch):
    out = launch("setup.sh", *TPU, "--repo-url", "https://example.com/c2.git", "--ref", "v1",
                 "--dry-run").stdout
    clone, bootstrap = (remote_command(c) for c in commands(out))
    assert "git clone -q https://example.com/c2.git c2" in clone
    assert "fetch -q origin v1" in clone and "checkout -q --force FETCH_HEAD" in clone
    assert bootstrap == "bash c2/launch/bootstrap.sh"


def test_bootstrap_is_idempotent(launch, tmp_path):
    venv = tmp_path / "venv"
    fresh = commands(launch("bootstrap.sh", "--dry-run", C2_VENV=str(venv)).stdout)
    assert fresh[-2] == [f"{venv}/bin/pip", "install", "--quiet", "-e", ".[tpu]"]
    assert fresh[-1] == ["cp", "setup.py", f"{venv}/c2-installed-setup.py"]
    assert any("venv" in argv for argv in fresh[:-3])   # python3 -m venv, or uv venv on 3.10

    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(shutil.which("true"))
    (venv / "c2-installed-setup.py").write_text("an older setup.py")
    changed = commands(launch("bootstrap.sh", "--dry-run", C2_VENV=str(venv)).stdout)
    assert not any("venv" in argv for argv in changed)   # the venv is reused
    assert [".[tpu]" in argv for argv in changed] == [False, True, False]

    shutil.copy(REPO_ROOT / "setup.py", venv / "c2-installed-setup.py")
    rerun = launch("bootstrap.sh", "--dry-run", C2_VENV=str(venv))
    assert rerun.stdout == "" and "already installed" in rerun.stderr   # nothing left to do


@pytest.mark.parametrize("present", [False, True])
def test_create_for_real_is_a_no_op_when_the_slice_exists(launch, tmp_path, present):
    path = fake_gcloud(tmp_path, describe_rc=0 if present else 1)
    launch("tpu.sh", "create", *TPU, "--type", "v5p-8", PATH=path)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith("compute tpus tpu-vm describe c2-v5p")
    assert len(calls) == (1 if present else 2)
    if not present:
        assert calls[1].startswith("compute tpus tpu-vm create c2-v5p")


def test_worker_for_real_tees_the_log_and_keeps_the_exit_code(launch, tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text('#!/bin/sh\necho "trained with $*"\nexit 3\n')
    (venv / "bin" / "python").chmod(0o755)
    workdir = tmp_path / "wd"
    proc = launch("worker.sh", EXP, str(workdir), "--", "--config.a=1", check=False,
                  C2_VENV=str(venv))   # a fake python: the override is never parsed
    assert proc.returncode == 3   # a failed run fails the launch
    (log,) = (workdir / "logs").iterdir()
    assert log.read_text() == f"trained with -m c2.main --config={EXP} --workdir={workdir} " \
                              "--config.a=1\n"
