"""Every command in launch/README.md, run as a dry run; every c2 command it leads to (directly,
through worker.sh on the TPU hosts or in the xpk pods, or through a sweep's launcher) parsed by
the real `c2.main` / `c2.aot` parser. A README command that would fail on a pod fails here."""
import re
import shlex
import subprocess
import sys

from launchtest import LAUNCH, REPO_ROOT, commands, parse_c2, run_script, worker_commands


def readme_commands():
    """The shell commands of launch/README.md's code block, continuation lines joined."""
    text = (LAUNCH / "README.md").read_text()
    block = text.split("```sh", 1)[1].split("```", 1)[0]
    block = re.sub(r"\\\n\s*", "", block)
    return [shlex.split(line) for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def c2_commands_of(printed, home):
    """The c2 commands among printed commands, following worker.sh and nested launchers."""
    found = []
    for argv in printed:
        if "-m" in argv and argv[argv.index("-m") + 1] in ("c2.main", "c2.aot"):
            found.append(argv)
        for nested in worker_commands(argv, home):
            found += c2_commands_of([nested], home)
        if argv and argv[0].startswith("launch/") and argv[0].endswith(".sh"):
            proc = run_script(argv[0][len("launch/"):], "--dry-run", *argv[1:], home=home)
            found += c2_commands_of(commands(proc.stdout), home)
    return found


def test_the_readme_shows_the_commands_this_test_runs():
    argvs = readme_commands()
    assert len(argvs) >= 9
    assert {argv[0] for argv in argvs} >= {"launch/aot.sh", "launch/tpu.sh", "launch/run.sh",
                                           "launch/xpk.sh", "launch/local.sh", "python"}


def test_every_readme_command_dry_runs_and_its_c2_commands_parse(tmp_path):
    home = tmp_path / "home"
    parsed = {}
    for argv in readme_commands():
        if argv[0] == "python":   # launch/sweep.py only prints the launcher commands
            out = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True,
                                 check=True, timeout=120, cwd=REPO_ROOT).stdout
            printed = commands(out)
            assert len(printed) == 3
        else:
            proc = run_script(argv[0][len("launch/"):], "--dry-run", *argv[1:], home=home)
            printed = commands(proc.stdout)
        for c2_argv in c2_commands_of(printed, home):
            parsed.setdefault(argv[0], []).append(parse_c2(c2_argv))
    # The AOT example compiles the full model for 4096 chips; the xpk example trains it on two
    # slices with the data axis over DCN; the local run and the sweep's points parse too.
    (exp, topology), = parsed["launch/aot.sh"]
    assert topology == "v5p:16x16x16" and exp.validate_for_devices(4096)["fsdp"] == 64
    xpk_exp, _ = parsed["launch/xpk.sh"][0]
    assert xpk_exp.mesh.num_slices == 2 and xpk_exp.validate_for_devices(4096)["data"] == 2
    assert [e.phase for e, _ in parsed["launch/run.sh"]] == ["pretrain"]
    assert len(parsed["launch/local.sh"]) == 1
    assert sorted(e.optim.peak_lr for e, _ in parsed["python"]) == [1e-3, 3e-3, 1e-2]
