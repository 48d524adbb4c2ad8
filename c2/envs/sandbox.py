"""Run one command the way the agent's `run` tool does: limited, isolated, killed as a whole tree.

  from c2.envs.sandbox import SandboxLimits, run_command
  result = run_command("pytest -q", workspace, SandboxLimits(wall_seconds=60))

Isolation (SandboxLimits.isolation):
  bwrap    bubblewrap namespaces on top of everything "rlimits" does: no network (an empty network
           namespace), only the system directories (`ro_paths`) visible and read-only (/root, /home,
           the real /tmp and the rest of the machine do not exist inside), the workspace bound
           read-write at its own path, private /tmp and /dev/shm tmpfs of `tmp_bytes` each (the
           rest of bwrap's own root and /dev read-only: unsized tmpfs are RAM to fill), own pid,
           ipc and uts namespaces, no nested user namespaces.
  rlimits  the limits and the private uid only: the whole file system is visible with the rights of
           an unprivileged uid (it can write its workspace and world-writable directories such as
           /tmp), and the network is reachable.
  none     a plain subprocess as the caller with the wall timeout only: the unsandboxed baseline of
           the throughput benchmark (a setsid escapee outlives it).
  auto     bwrap when it works on this machine, else rlimits with one loud warning, or an error
           with require_isolation.

What bwrap and rlimits enforce (as root; without root there is no uid switch, see _describe):
  * A private uid per command from a pool (c2/envs/sandbox_host.py), held with flock (so no
    two threads or processes share one). Linux counts RLIMIT_NPROC per uid system-wide and ignores
    it for root, so a private uid is what makes the process limit real, and "kill every process of
    the uid" a complete tree kill that catches setsid escapees. The workspace is chowned to it
    before each command (lchown; hardlinked files skipped so a planted hardlink cannot hand a
    foreign file over) and its root made 0700, so other sandboxes cannot read it.
  * RLIMIT_CPU (SIGXCPU at cpu_seconds, SIGKILL a second later), RLIMIT_AS = memory_bytes per
    process (a tree may hold max_processes x memory_bytes: cgroups would bound the sum but are not
    reliably available), RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_FSIZE, no core files.
  * Every command runs under c2/envs/sandbox_init.py, a subreaper that kills and reaps the whole
    uid when the command exits (background children do not outlive it), at the wall deadline,
    on a disk-quota breach, or when the caller dies.
  * Disk: RLIMIT_FSIZE bounds each file. The workspace total (allocated bytes and entries; in
    rlimits mode plus the uid's entries in /tmp, /var/tmp, /dev/shm, which are deleted afterwards)
    is walked whenever statvfs shows enough free space gone since the last walk that the quota
    could be exceeded, and the command is killed when over it: the overshoot is what it writes in
    one disk_poll_seconds (measured here: ~50 MB at 0.1 s). Under bwrap /tmp is a tmpfs.
  * Output: stdout and stderr share one pipe, read as it comes; the first and last halves of
    max_output_bytes are kept around a "[... N bytes truncated ...]" marker.
run_command is thread-safe: all state is per call except the uid locks and the one-time probe.

`python -m c2.envs.sandbox [--workspace DIR] -- CMD ...` runs one command like this and prints its
output and a status line saying what isolation this machine gave it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Mapping, Sequence

from c2.envs import sandbox_host
from c2.envs.sandbox_host import workspace_parent  # public here: where workspaces live

log = logging.getLogger(__name__)

ISOLATIONS = ("auto", "bwrap", "rlimits", "none")
_INIT_SCRIPT = pathlib.Path(__file__).with_name("sandbox_init.py")
_STOP_GRACE_SECONDS = 10.0  # the init normally needs milliseconds to kill and reap a tree
_DRAIN_SECONDS = 1.0  # "none" mode: how long an escapee holding the pipe may delay the return


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """What one command may use. Byte sizes are bytes; see the module docstring for enforcement."""
  cpu_seconds: float = 10.0
  wall_seconds: float = 20.0
  memory_bytes: int = 1 << 30  # RLIMIT_AS, per process
  max_processes: int = 64
  max_open_files: int = 256
  max_file_bytes: int = 64 << 20  # RLIMIT_FSIZE: the largest file a command may write
  max_output_bytes: int = 64 << 10  # captured stdout+stderr kept; the rest replaced by a marker
  workspace_bytes: int = 256 << 20  # disk quota of the workspace (polled, see module docstring)
  workspace_files: int = 100_000  # entries allowed in the workspace (inodes are a disk too)
  tmp_bytes: int = 64 << 20  # size of the private /tmp tmpfs under bwrap
  isolation: str = "auto"
  require_isolation: bool = False  # auto without working bwrap raises instead of warning
  ro_paths: tuple[str, ...] = sandbox_host.SYSTEM_DIRS  # bwrap shows these read-only, links kept
  disk_poll_seconds: float = 0.1

  def __post_init__(self):
    if self.isolation not in ISOLATIONS:
      raise ValueError(f"isolation={self.isolation!r}: expected one of {ISOLATIONS}")
    for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "max_processes", "max_open_files",
                 "max_file_bytes", "max_output_bytes", "workspace_bytes", "workspace_files",
                 "tmp_bytes", "disk_poll_seconds"):
      if not getattr(self, name) > 0:
        raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class CommandResult:
  """One finished command. exit_code follows the shell: 128 + N when signal N ended it."""
  exit_code: int
  output: str  # stdout and stderr interleaved, truncated to max_output_bytes with a marker
  timed_out: bool
  truncated: bool
  wall_seconds: float
  isolation: str  # the mode actually used ("bwrap", "rlimits" or "none"; never "auto")
  killed_by: str | None = None  # "wall timeout", "disk quota ...", "cpu limit (SIGXCPU)", a signal
  output_bytes: int = 0  # everything the command printed, before truncation
  uid: int | None = None  # the private sandbox uid it ran as (None: the caller's)


# ---- which isolation -------------------------------------------------------------------------

_probe_lock = threading.Lock()
_probe: dict[str, str | None] = {}  # "problem" -> why bwrap does not work here (None: it works)


def bwrap_problem() -> str | None:
  """Why bubblewrap cannot sandbox commands here, or None when it can (probed once per process)."""
  with _probe_lock:
    if "problem" not in _probe:
      problem = None
      if shutil.which("bwrap") is None:
        problem = "bubblewrap is not installed (apt-get install bubblewrap)"
      else:
        probe_dir = pathlib.Path(tempfile.mkdtemp(dir=workspace_parent()))
        try:
          r = _lend_and_run(["true"], probe_dir, SandboxLimits(wall_seconds=30), "bwrap")
          if r.exit_code != 0:
            problem = f"bwrap is installed but failed here: {r.output.strip()[-500:]!r}"
        finally:
          shutil.rmtree(probe_dir, ignore_errors=True)
      _probe["problem"] = problem
    return _probe["problem"]


def resolve_isolation(limits: SandboxLimits) -> str:
  """The mode `limits` gets on this machine; warns loudly once when auto falls back to rlimits."""
  if limits.isolation in ("none", "rlimits"):
    return limits.isolation
  problem = bwrap_problem()
  if problem is None:
    return "bwrap"
  if limits.isolation == "bwrap" or limits.require_isolation:
    raise RuntimeError(f"sandbox isolation {limits.isolation!r} needs bubblewrap: {problem}")
  with _probe_lock:
    if not _probe.get("warned"):
      _probe["warned"] = "yes"
      log.warning(
          "SANDBOX WITHOUT NAMESPACES: %s. Commands run with rlimits and a private uid only: NO "
          "network isolation, the whole file system readable where unix permissions allow, no pid "
          "namespace. Install bubblewrap (apt-get install bubblewrap), or set "
          "require_isolation=True to make this an error.", problem)
  return "rlimits"


def _describe(isolation: str) -> str:
  """What a mode gives on this machine, for the CLI's status line."""
  if isolation == "none":
    return "network, file system and processes NOT isolated; wall timeout only"
  as_root = os.geteuid() == 0
  who = ("a private uid, rlimits incl. processes" if as_root else
         "YOUR uid (not root: no uid switch, no process-count limit), other rlimits")
  if isolation == "bwrap":
    return f"network: none; file system: system read-only, workspace writable, rest hidden; " \
           f"processes: own pid namespace, {who}"
  return f"network: NOT isolated; file system: all visible, writable where the uid may; " \
         f"processes: {who}"


# ---- running ---------------------------------------------------------------------------------

class _Output:
  """Head and tail of a stream of unbounded length, in bounded memory."""

  def __init__(self, limit: int):
    self._head_cap, self._tail_cap = limit - limit // 2, limit // 2
    self._head, self._tail, self.total = bytearray(), bytearray(), 0

  def add(self, chunk: bytes) -> None:
    self.total += len(chunk)
    take = max(0, min(len(chunk), self._head_cap - len(self._head)))
    self._head += chunk[:take]
    self._tail += chunk[take:]
    if len(self._tail) > 2 * self._tail_cap:
      del self._tail[:len(self._tail) - self._tail_cap]

  @property
  def truncated(self) -> bool:
    return self.total > self._head_cap + self._tail_cap

  def text(self) -> str:
    if not self.truncated:
      return (self._head + self._tail).decode(errors="replace")
    tail = self._tail[len(self._tail) - self._tail_cap:] if self._tail_cap else b""
    dropped = self.total - len(self._head) - len(tail)
    return (self._head.decode(errors="replace") + f"\n[... {dropped} bytes truncated ...]\n" +
            tail.decode(errors="replace"))


def _bwrap_argv(root: pathlib.Path, limits: SandboxLimits) -> list[str]:
  argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns",
          "--die-with-parent", "--new-session", "--hostname", "sandbox"]
  for path in limits.ro_paths:
    if os.path.islink(path):  # merged /usr: /bin -> usr/bin stays a link into the bound /usr
      argv += ["--symlink", os.readlink(path), path]
    elif os.path.exists(path):
      argv += ["--ro-bind", path, path]
  aliases = str(sandbox_host.command_aliases())
  size = ["--size", str(limits.tmp_bytes)]
  # --tmpfs /tmp before --bind: bwrap creates the workspace's parent directories inside it. Then
  # bwrap's own root and /dev tmpfs become read-only: unsized, they would be RAM to fill.
  return argv + ["--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--proc", "/proc", *size,
                 "--tmpfs", "/tmp", "--bind", str(root), str(root), "--ro-bind", aliases, aliases,
                 "--remount-ro", "/dev",
                 "--remount-ro", "/", "--chdir", str(root), "--"]


def _rlimits(limits: SandboxLimits, uid: int | None) -> dict[str, tuple[int, int]]:
  cpu = math.ceil(limits.cpu_seconds)
  rl = {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (limits.memory_bytes,) * 2,
        "RLIMIT_NOFILE": (limits.max_open_files,) * 2, "RLIMIT_FSIZE": (limits.max_file_bytes,) * 2,
        "RLIMIT_CORE": (0, 0)}
  if uid is not None:  # without a private uid the count would include all of the caller's processes
    rl["RLIMIT_NPROC"] = (limits.max_processes,) * 2
  return rl


def _killed_by(exit_code: int) -> str | None:
  if exit_code <= 128 or exit_code - 128 not in signal.valid_signals():
    return None
  name = signal.Signals(exit_code - 128).name
  return {"SIGXCPU": "cpu limit (SIGXCPU)", "SIGXFSZ": "file size limit (SIGXFSZ)"}.get(name, name)


def _feed(pipe, data: bytes) -> None:
  with contextlib.suppress(OSError):  # the command may exit without reading it all
    with pipe:
      pipe.write(data)


def _run_in(argv: list[str], root: pathlib.Path, limits: SandboxLimits, isolation: str,
            uid: int | None, env: Mapping[str, str] | None = None,
            stdin: str | None = None) -> CommandResult:
  """Start, watch and collect one command in an already prepared workspace."""
  if isolation != "none":
    argv = (_bwrap_argv(root, limits) if isolation == "bwrap" else []) + argv
    rlimits = ",".join(f"{k}={soft}:{hard}" for k, (soft, hard) in _rlimits(limits, uid).items())
    argv = [sys.executable, "-I", "-S", "-B", str(_INIT_SCRIPT), str(os.getpid()),
            "-" if uid is None else str(uid), rlimits, "--", *argv]
  aliases = str(sandbox_host.command_aliases())
  base_env = {"PATH": f"{aliases}:/usr/local/bin:/usr/bin:/bin", "HOME": str(root), "TMPDIR": "/tmp",
              "LANG": "C.UTF-8", "TERM": "dumb", "USER": "sandbox", "LOGNAME": "sandbox"}
  watch = None
  if isolation != "none":
    def quota_paths():
      leftovers = isolation == "rlimits" and uid is not None
      return [root, *sandbox_host.uid_leftovers(uid, root)] if leftovers else [root]
    watch = sandbox_host.DiskWatch(quota_paths, [str(root), *sandbox_host.SHARED_TMP_DIRS],
                                   limits.workspace_bytes, limits.workspace_files)
  start = time.monotonic()
  proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=root,
                          env={**base_env, **(env or {})}, start_new_session=True)
  if stdin is not None:
    threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True).start()
  out, fd, pidfd = _Output(limits.max_output_bytes), proc.stdout.fileno(), os.pidfd_open(proc.pid)
  with contextlib.suppress(OSError):
    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)  # fewer wake-ups for chatty commands
  poller = select.poll()
  poller.register(fd, select.POLLIN)
  poller.register(pidfd, select.POLLIN)
  stop_reason, stopped_at, exited_at, eof = None, None, None, False
  next_disk_check = start + limits.disk_poll_seconds

  def stop(force: bool = False):
    if isolation == "none" or force:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
      if force:
        os.kill(proc.pid, signal.SIGKILL)
    else:  # the init kills and reaps every process of the uid, then exits
      os.kill(proc.pid, signal.SIGTERM)

  try:
    while not (eof and exited_at is not None):
      now = time.monotonic()
      if stop_reason is None and exited_at is None:
        if now >= start + limits.wall_seconds:
          stop_reason = "wall timeout"
        elif watch is not None and now >= next_disk_check:
          next_disk_check = now + limits.disk_poll_seconds
          stop_reason = watch.breach()
        if stop_reason is not None:
          stop()
          stopped_at = now
      if stopped_at is not None and exited_at is None and now > stopped_at + _STOP_GRACE_SECONDS:
        log.error("sandbox init %d ignored SIGTERM for %ss; killing it", proc.pid,
                  _STOP_GRACE_SECONDS)
        stop(force=True)
        stopped_at = now
      if exited_at is not None and now > exited_at + _DRAIN_SECONDS:
        break  # only "none" gets here: something outside our reach still holds the pipe
      if stopped_at is None and exited_at is None:
        wait = min(start + limits.wall_seconds, next_disk_check if watch else math.inf) - now
      else:  # waiting for the kill to land, or draining after the exit
        wait = 0.05
      for ready, _ in poller.poll(max(1, 1000 * wait)):
        if ready == fd:
          chunk = os.read(fd, 1 << 20)
          if chunk:
            out.add(chunk)
          else:
            eof = True
            poller.unregister(fd)
        else:
          exited_at = time.monotonic()
          poller.unregister(pidfd)
          if isolation == "none":  # background children of the baseline die with it
            with contextlib.suppress(ProcessLookupError):
              os.killpg(proc.pid, signal.SIGKILL)
  finally:
    if proc.poll() is None:  # only after an exception in the loop above (e.g. KeyboardInterrupt)
      stop()
      try:
        proc.wait(_STOP_GRACE_SECONDS)
      except subprocess.TimeoutExpired:
        stop(force=True)
    code = proc.wait()
    os.close(pidfd)
    proc.stdout.close()
  code = 128 - code if code < 0 else code
  return CommandResult(
      exit_code=code, output=out.text(), timed_out=stop_reason == "wall timeout",
      truncated=out.truncated, wall_seconds=time.monotonic() - start, isolation=isolation,
      killed_by=stop_reason or _killed_by(code), output_bytes=out.total, uid=uid)


def run_command(command: str | Sequence[str], workspace, limits: SandboxLimits = SandboxLimits(),
                *, stdin: str | None = None, env: Mapping[str, str] | None = None) -> CommandResult:
  """Run `command` in `workspace` (a path or a Workspace) under `limits` and collect the result.

  Never raises for what the command does; raises for a workspace that cannot be lent to a sandbox
  and for an isolation that was required but is not available.

  A str runs through bash -c (sh when there is no bash), a sequence as argv. The environment is a
  small fixed one (PATH, HOME=workspace, TMPDIR=/tmp, LANG=C.UTF-8) plus `env`.
  """
  if isinstance(command, str):
    argv = ["/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh", "-c", command]
  else:
    argv = [os.fspath(a) for a in command]
  root = pathlib.Path(os.path.realpath(os.fspath(workspace)))
  return _lend_and_run(argv, root, limits, resolve_isolation(limits), env, stdin)


def _lend_and_run(argv: list[str], root: pathlib.Path, limits: SandboxLimits, isolation: str,
                  env: Mapping[str, str] | None = None, stdin: str | None = None) -> CommandResult:
  """Lend the workspace to a private uid (as root), run, and clean up after that uid."""
  uid_switch = isolation != "none" and os.geteuid() == 0
  sandbox_host.check_lendable(root, uid_switch)
  if not uid_switch:
    return _run_in(argv, root, limits, isolation, None, env, stdin)
  with sandbox_host.lease_uid(preferred=root.stat().st_uid) as uid:
    os.chmod(root, 0o700)
    sandbox_host.chown_tree(root, uid, uid)
    try:
      return _run_in(argv, root, limits, isolation, uid, env, stdin)
    finally:
      for leftover in sandbox_host.uid_leftovers(uid, root) if isolation == "rlimits" else ():
        sandbox_host.remove(leftover)


# ---- command line ----------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
  """`python -m c2.envs.sandbox [options] -- CMD ...`: one argument is a shell line, more argv."""
  parser = argparse.ArgumentParser(
      prog="python -m c2.envs.sandbox",
      description="Run one command exactly as the agent's run tool does and say what isolation "
                  "it got. A --workspace directory is lent to the sandbox uid for the run "
                  "(ownership restored afterwards); without one a fresh temporary one is used.")
  parser.add_argument("--workspace", type=pathlib.Path)
  parser.add_argument("--isolation", choices=ISOLATIONS, default="auto")
  parser.add_argument("--require-isolation", action="store_true")
  defaults = SandboxLimits()
  for field in ("wall_seconds", "cpu_seconds", "memory_bytes", "max_processes", "max_output_bytes",
                "workspace_bytes"):
    kind = type(getattr(defaults, field))
    parser.add_argument("--" + field.replace("_", "-"), type=kind, default=getattr(defaults, field))
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("no command given (put it after --)")
  limits = SandboxLimits(
      isolation=args.isolation, require_isolation=args.require_isolation,
      **{f: getattr(args, f) for f in ("wall_seconds", "cpu_seconds", "memory_bytes",
                                       "max_processes", "max_output_bytes", "workspace_bytes")})
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  workspace = args.workspace or pathlib.Path(tempfile.mkdtemp(dir=workspace_parent()))
  owner = workspace.stat()
  try:
    result = run_command(command[0] if len(command) == 1 else command, workspace, limits)
  finally:
    if args.workspace is None:
      shutil.rmtree(workspace, ignore_errors=True)
    elif os.geteuid() == 0:  # give the user's directory back as it was
      sandbox_host.chown_tree(workspace.resolve(), owner.st_uid, owner.st_gid)
      os.chmod(workspace, owner.st_mode & 0o7777)
  sys.stdout.write(result.output if result.output.endswith("\n") or not result.output else
                   result.output + "\n")
  print(f"[sandbox] exit {result.exit_code} | timed out: {result.timed_out} | truncated: "
        f"{result.truncated} ({result.output_bytes} bytes printed) | killed by: {result.killed_by} "
        f"| {result.wall_seconds:.2f} s | isolation: {result.isolation} "
        f"({_describe(result.isolation)})")
  return min(result.exit_code, 255)


if __name__ == "__main__":
  sys.exit(main())
