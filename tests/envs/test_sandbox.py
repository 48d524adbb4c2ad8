"""The sandbox: behaviour of run_command, and the adversarial battery.

Every attack runs in both real isolation modes ("bwrap", skipped with the reason when bubblewrap
does not work here, and "rlimits") with small limits, in a thread, while the main thread keeps
serving another workspace (`_contained_while_serving`): containment means the attack is stopped
AND the other rollout's commands still come back right. After each attack no process of the
sandbox uid may remain, zombies included.
"""
import contextlib
import logging
import os
import pathlib
import shutil
import socket
import tempfile
import threading
import time

import pytest

from c2.envs import sandbox, sandbox_host
from c2.envs.sandbox import SandboxLimits, run_command
from c2.envs.workspace import PathOutsideWorkspace, Workspace

SMALL = dict(wall_seconds=3.0, cpu_seconds=2.0, memory_bytes=256 << 20, max_output_bytes=64 << 10,
             max_processes=32)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="private sandbox uids need root")


@pytest.fixture(params=["bwrap", "rlimits"])
def isolation(request):
  if request.param == "bwrap" and sandbox.bwrap_problem():
    pytest.skip(f"bwrap unusable here: {sandbox.bwrap_problem()}")
  return request.param


@pytest.fixture
def ws():
  with Workspace.create({"hello.txt": "hi\n"}) as w:
    yield w


@pytest.fixture
def other_ws():
  with Workspace.create({"other.txt": "other\n"}) as w:
    yield w


def _processes_of(uid):
  """Pids (zombies included) whose real uid is `uid`."""
  found = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      with contextlib.suppress(OSError):
        status = pathlib.Path(f"/proc/{name}/status").read_text()
        if int(status.split("\nUid:")[1].split()[0]) == uid:
          found.append(int(name))
  return found


def _contained_while_serving(attack, other_ws, isolation, limits=SMALL):
  """Run attack(limits) in a thread while echo commands keep running in other_ws; return the
  attack's CommandResult after checking every echo came back and the attack's uid is empty."""
  box = {}

  def run():
    try:
      box["result"] = attack(SandboxLimits(isolation=isolation, **limits))
    except BaseException as e:  # re-raised below, in the test's thread
      box["error"] = e

  thread = threading.Thread(target=run)
  thread.start()
  served = 0
  while thread.is_alive() or served == 0:
    r = run_command("cat other.txt", other_ws, SandboxLimits(isolation=isolation, **SMALL))
    assert (r.exit_code, r.output) == (0, "other\n"), r
    served += 1
  thread.join()
  if "error" in box:
    raise box["error"]
  result = box["result"]
  if result.uid is not None:
    assert _processes_of(result.uid) == [], f"processes of uid {result.uid} survived"
  return result


def _limits(isolation, **kw):
  return SandboxLimits(isolation=isolation, **{**SMALL, **kw})


# ---- plain behaviour ----------------------------------------------------------------------------

def test_runs_in_workspace_as_unprivileged_uid(ws, isolation):
  r = run_command("cat hello.txt; echo out; echo err >&2; id -u; pwd; echo new > made.txt; exit 3",
                  ws, _limits(isolation))
  lines = r.output.splitlines()
  assert (r.exit_code, r.timed_out, r.truncated, r.isolation) == (3, False, False, isolation)
  assert lines[:3] == ["hi", "out", "err"]
  if os.geteuid() == 0:
    assert int(lines[3]) == r.uid >= sandbox_host.UID_BASE
  assert lines[4] == str(ws.root)
  assert (ws.root / "made.txt").read_text() == "new\n"
  argv = run_command(["python3", "-c", "import sys; print(sys.stdin.read().upper())"], ws,
                     _limits(isolation), stdin="piped")
  assert (argv.exit_code, argv.output) == (0, "PIPED\n")


def test_none_is_a_plain_subprocess_with_a_timeout(ws):
  r = run_command("id -u; sleep 30", ws, SandboxLimits(isolation="none", wall_seconds=1))
  assert (r.output, r.timed_out, r.killed_by, r.uid) == (f"{os.geteuid()}\n", True,
                                                          "wall timeout", None)
  assert r.wall_seconds < 3


def test_output_keeps_head_and_tail_with_marker(ws, isolation):
  r = run_command("echo FIRST; head -c 200000 /dev/zero | tr '\\0' x; echo; echo LAST", ws,
                  _limits(isolation, max_output_bytes=1000))
  assert r.truncated and r.output_bytes == 6 + 200000 + 1 + 5
  assert r.output.startswith("FIRST\nxxx") and r.output.endswith("xxx\nLAST\n")
  dropped = r.output_bytes - 1000
  assert f"\n[... {dropped} bytes truncated ...]\n" in r.output
  assert len(r.output) == 1000 + len(f"\n[... {dropped} bytes truncated ...]\n")


def test_threads_get_distinct_uids_and_their_own_output(isolation):
  workspaces = [Workspace.create({"n.txt": str(i)}) for i in range(6)]
  results = [None] * 6

  def one(i):
    results[i] = run_command("cat n.txt; sleep 0.2", workspaces[i], _limits(isolation))

  threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for w in workspaces:
    w.cleanup()
  assert [r.output for r in results] == [str(i) for i in range(6)]
  if os.geteuid() == 0:
    assert len({r.uid for r in results}) == 6


def test_auto_without_bwrap_warns_once_or_raises(ws, monkeypatch, caplog):
  monkeypatch.setattr(sandbox, "_probe", {"problem": "bubblewrap is not installed (apt-get "
                                                     "install bubblewrap)"})
  with caplog.at_level(logging.WARNING, logger="c2.envs.sandbox"):
    first = run_command("true", ws, SandboxLimits(wall_seconds=5))
    second = run_command("true", ws, SandboxLimits(wall_seconds=5))
  assert (first.isolation, second.isolation) == ("rlimits", "rlimits")
  warnings = [r for r in caplog.records if "NO network isolation" in r.getMessage()]
  assert len(warnings) == 1
  with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
    run_command("true", ws, SandboxLimits(require_isolation=True))
  with pytest.raises(RuntimeError, match="needs bubblewrap"):
    run_command("true", ws, SandboxLimits(isolation="bwrap"))


def test_bad_limits_and_workspaces_are_refused(tmp_path):
  with pytest.raises(ValueError, match="isolation"):
    SandboxLimits(isolation="docker")
  with pytest.raises(ValueError, match="wall_seconds"):
    SandboxLimits(wall_seconds=0)
  with pytest.raises(ValueError, match="system directory"):
    run_command("true", "/", SandboxLimits(isolation="rlimits"))
  if os.geteuid() == 0:
    hidden = tmp_path / "closed"
    (hidden / "ws").mkdir(parents=True)
    hidden.chmod(0o700)
    with pytest.raises(PermissionError, match="chmod o\\+x"):
      run_command("true", hidden / "ws", SandboxLimits(isolation="rlimits"))


def test_cli_prints_output_and_status(capsys):
  assert sandbox.main(["--isolation", "rlimits", "--wall-seconds", "5", "--", "echo", "hi"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("hi\n[sandbox] exit 0 |") and "isolation: rlimits (network: NOT" in out
  assert sandbox.main(["--isolation", "none", "--", "exit 3"]) == 3
  with Workspace.create({}) as w:  # a user's directory is lent for the run, then given back
    w.root.chmod(0o755)
    assert sandbox.main(["--workspace", str(w.root), "--isolation", "rlimits", "--",
                         "touch made"]) == 0
    made, root = (w.root / "made").stat(), w.root.stat()
    assert (made.st_uid, root.st_uid, root.st_mode & 0o777) == (os.geteuid(), os.geteuid(), 0o755)


# ---- the adversarial battery --------------------------------------------------------------------

@pytest.fixture
def outside():
  """A directory outside every workspace, private to root like a real secret's home."""
  path = pathlib.Path(tempfile.mkdtemp(prefix="c2-outside-"))
  (path / "secret.txt").write_text("TOPSECRET\n")
  (path / "secret.txt").chmod(0o644)
  yield path
  shutil.rmtree(path)


@needs_root
def test_write_outside_directly_and_via_dotdot(ws, other_ws, outside, isolation):
  attack = f"echo pwned > {outside}/new.txt; echo pwned > ../escape.txt; " \
           f"echo pwned > {other_ws.root}/other.txt; echo pwned > /etc/pwned; echo done"
  r = _contained_while_serving(lambda lim: run_command(attack, ws, lim), other_ws, isolation)
  # Under bwrap `..` is the private /tmp tmpfs (the write succeeds there and vanishes with it).
  refusals = r.output.splitlines()[:-1]
  assert r.output.endswith("done\n") and len(refusals) == (3 if isolation == "bwrap" else 4)
  assert all(("Permission denied" in line or "Read-only file system" in line or
              "No such file" in line) for line in refusals), refusals
  assert not (outside / "new.txt").exists() and not (ws.root.parent / "escape.txt").exists()
  assert not pathlib.Path("/etc/pwned").exists()
  assert (other_ws.root / "other.txt").read_text() == "other\n"


@needs_root
def test_write_outside_via_symlink_in_sandbox_and_file_tools(ws, other_ws, outside, isolation):
  attack = f"ln -s {outside} out; ln -s {outside}/secret.txt sec; ln -s /etc/passwd pw; " \
           f"echo pwned > out/new.txt; echo pwned >> sec; echo done"
  r = _contained_while_serving(lambda lim: run_command(attack, ws, lim), other_ws, isolation)
  assert r.output.endswith("done\n")
  assert not (outside / "new.txt").exists()
  assert (outside / "secret.txt").read_text() == "TOPSECRET\n"
  # Then the policy asks the file tools (our process, root) to follow the links it made.
  for name in ("out/new.txt", "sec", "pw", "out"):
    with pytest.raises(PathOutsideWorkspace, match="outside the workspace"):
      ws.resolve(name)


@needs_root
def test_write_to_shared_tmp_does_not_persist(ws, other_ws, isolation):
  marker = pathlib.Path(f"/tmp/c2-leak-{os.getpid()}-{isolation}")
  r = _contained_while_serving(
      lambda lim: run_command(f"mkdir {marker} && echo x > {marker}/f && cat {marker}/f", ws, lim),
      other_ws, isolation)
  assert r.output == "x\n"  # private tmpfs under bwrap, the real /tmp under rlimits ...
  assert not marker.exists()  # ... whose leftovers are deleted when the command ends


@needs_root
def test_read_planted_secret(ws, other_ws, outside, isolation):
  attack = f"cat {outside}/secret.txt; cat /root/.bashrc /etc/shadow | head -c 100; echo done"
  r = _contained_while_serving(lambda lim: run_command(attack, ws, lim), other_ws, isolation)
  assert "TOPSECRET" not in r.output and r.output.endswith("done\n")
  if isolation == "bwrap":  # rlimits shows what unix permissions show; bwrap hides the rest
    outside.chmod(0o755)
    r = run_command(f"cat {outside}/secret.txt", ws, _limits(isolation))
    assert "TOPSECRET" not in r.output and "No such file" in r.output


def test_open_socket(ws, other_ws, isolation):
  server = socket.create_server(("127.0.0.1", 0))  # a service on the host's loopback
  port = server.getsockname()[1]
  attack = ("import socket\n"
            f"for host, port in (('127.0.0.1', {port}), ('1.1.1.1', 80)):\n"
            "  try:\n"
            "    socket.create_connection((host, port), timeout=1); print(host, 'CONNECTED')\n"
            "  except OSError as e:\n"
            "    print(host, type(e).__name__, e.strerror)")
  r = _contained_while_serving(lambda lim: run_command(["python3", "-c", attack], ws, lim),
                               other_ws, isolation)
  server.close()
  local, remote = r.output.splitlines()
  if isolation == "bwrap":  # an empty network namespace: its own loopback, no routes
    assert local == "127.0.0.1 ConnectionRefusedError Connection refused"
    assert remote == "1.1.1.1 OSError Network is unreachable"
  else:  # documented: rlimits mode has no network isolation (the fallback warning says so)
    assert local == "127.0.0.1 CONNECTED"


@needs_root
def test_fork_bomb(ws, other_ws, isolation):
  # First the bounded proof that the process limit holds: 200 children, at most 32 processes.
  bounded = "import subprocess\nstarted = failed = 0\nfor _ in range(200):\n  try:\n" \
            "    subprocess.Popen(['sleep', '3']); started += 1\n  except OSError:\n" \
            "    failed += 1\nprint(started, failed)"
  r = run_command(["python3", "-c", bounded], ws, _limits(isolation))
  started, failed = map(int, r.output.split())
  assert started + failed == 200 and started < 32 and failed > 160
  assert _processes_of(r.uid) == []
  # Only then the real one.
  r = _contained_while_serving(
      lambda lim: run_command(":(){ :|:& };:; sleep 1; echo end", ws, lim), other_ws, isolation)
  assert "Resource temporarily unavailable" in r.output or r.timed_out


def test_unbounded_memory(ws, other_ws, isolation):
  attack = "python3 -c 'x = []\nwhile True: x.append(bytearray(10 ** 7))'"
  r = _contained_while_serving(lambda lim: run_command(attack, ws, lim), other_ws, isolation)
  assert r.exit_code != 0 and "MemoryError" in r.output and not r.timed_out


def test_infinite_loop_hits_cpu_limit(ws, other_ws, isolation):
  r = _contained_while_serving(
      lambda lim: run_command("while :; do :; done", ws, lim), other_ws, isolation,
      limits={**SMALL, "cpu_seconds": 1.0})
  assert (r.exit_code, r.killed_by) == (128 + 24, "cpu limit (SIGXCPU)") or r.timed_out
  assert r.wall_seconds < SMALL["wall_seconds"] + 1


def test_sleep_past_timeout(ws, other_ws, isolation):
  r = _contained_while_serving(
      lambda lim: run_command("echo before; sleep 100", ws, lim), other_ws, isolation,
      limits={**SMALL, "wall_seconds": 1.5})
  assert (r.output, r.timed_out, r.killed_by) == ("before\n", True, "wall timeout")
  assert r.exit_code == 128 + 9
  assert 1.5 <= r.wall_seconds < 3


@needs_root
def test_child_outlives_parent(ws, other_ws, isolation):
  attack = "(sleep 100 &); setsid sleep 100 & nohup sleep 100 >/dev/null 2>&1 & " \
           "setsid bash -c 'while :; do sleep 0.1; done' & echo started"
  r = _contained_while_serving(lambda lim: run_command(attack, ws, lim), other_ws, isolation)
  assert (r.exit_code, r.output, r.timed_out) == (0, "started\n", False)
  assert r.wall_seconds < 2  # background children neither block the return nor survive it


def _rss_bytes():
  status = pathlib.Path("/proc/self/status").read_text()
  return int(status.split("VmRSS:")[1].split()[0]) * 1024


def test_print_gigabytes(ws, other_ws, isolation):
  peak, done = [_rss_bytes()], threading.Event()

  def sample():
    while not done.is_set():
      peak.append(_rss_bytes())
      time.sleep(0.02)

  baseline = peak[0]
  sampler = threading.Thread(target=sample)
  sampler.start()
  try:
    r = _contained_while_serving(lambda lim: run_command("yes | head -c 3G", ws, lim), other_ws,
                                 isolation, limits={**SMALL, "wall_seconds": 2.0})
  finally:
    done.set()
    sampler.join()
  assert r.truncated and "bytes truncated ...]" in r.output and r.output_bytes > 20 << 20
  assert len(r.output) < (64 << 10) + 100
  assert max(peak) - baseline < 64 << 20, "our memory grew with the command's output"


@needs_root
def test_fill_the_disk(ws, other_ws, isolation):
  limits = {**SMALL, "workspace_bytes": 16 << 20, "max_file_bytes": 4 << 20, "wall_seconds": 5.0}
  attack = "head -c 100M /dev/zero > one_big; i=0; while head -c 4M /dev/zero > f$i; " \
           "do i=$((i+1)); done; echo stopped at $i"
  r = _contained_while_serving(lambda lim: run_command(attack, ws, lim), other_ws, isolation,
                               limits=limits)
  used, _ = sandbox_host.disk_usage([ws.root])
  assert (ws.root / "one_big").stat().st_size == 4 << 20  # RLIMIT_FSIZE cut the single file
  assert r.killed_by and r.killed_by.startswith("disk quota"), r
  assert used < 128 << 20, f"workspace grew to {used} bytes"  # quota + one poll's writes
  # The same through the shared /tmp (rlimits mode) or the private tmpfs (bwrap).
  attack = "d=$(mktemp -d); i=0; while head -c 4M /dev/zero > $d/f$i; do i=$((i+1)); done; " \
           "echo stopped at $i"
  r = _contained_while_serving(lambda lim: run_command(attack, ws, lim), other_ws, isolation,
                               limits=limits)
  assert r.exit_code != 0 or "No space left" in r.output
  assert sandbox_host.uid_leftovers(r.uid, ws.root) == []
