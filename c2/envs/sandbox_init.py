"""The init process of one sandboxed command: limits, privilege drop, and a guaranteed tree kill.

c2.envs.sandbox starts this file as a script (`python -I -S sandbox_init.py SPEC...`) for every
command in the "bwrap" and "rlimits" modes. It imports only a few standard modules (not json or
signal's enum wrapper, 8 ms each) and starts in 15-30 ms here. It runs as the caller (root) and:
  1. becomes a child subreaper, so every orphan of the command (a `(sleep 100 &)`, a `setsid`
     escapee, the inner bwrap process) is reparented to it instead of to the machine's pid 1, which
     on our machines never reaps (zombies would pile up and count against the sandbox uid's
     process limit);
  2. forks the command: setsid, drop to the sandbox uid, kill whatever that uid still runs, set the
     rlimits, no_new_privs, exec;
  3. waits for the command; when it exits, or on SIGTERM from the caller (wall timeout, disk quota)
     or the caller's death (PR_SET_PDEATHSIG), kills every process of the sandbox uid with
     kill(-1) from a helper running as that uid (atomic with respect to fork, so a fork bomb cannot
     outrun it) and reaps until it has no children left;
  4. exits with the command's status, 128 + signal number when a signal ended it.
Without root (uid null in SPEC) it cannot switch uids, so step 3 kills its own descendants instead.

SPEC is `CALLER_PID UID|- RLIMIT_AS=soft:hard,RLIMIT_CPU=soft:hard,... -- ARGV...` (parsed by
_parse_spec). The command's output is this process's stdout/stderr, inherited.
"""
import ctypes
import os
import resource

# The C module under `signal`: the wrapper's enum import alone costs ~8 ms of start-up.
import _signal as signal
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_KILL_GRACE_SECONDS = 5.0  # kill(-1) is retried until every descendant is reaped, this long at most


class _Stop(Exception):
  """Raised from the signal handler: the caller wants the command gone."""


_libc = ctypes.CDLL(None, use_errno=True)


def _parse_spec(args):
  caller, uid, rlimits, dashes, *argv = args
  if dashes != "--" or not argv:
    raise SystemExit(f"usage: sandbox_init.py CALLER UID|- RLIMITS -- ARGV... (got {args!r})")
  limits = {}
  for item in filter(None, rlimits.split(",")):
    name, values = item.split("=")
    soft, hard = values.split(":")
    limits[name] = (int(soft), int(hard))
  return {"caller": int(caller), "uid": None if uid == "-" else int(uid), "rlimits": limits,
          "argv": argv}


def _prctl(option, arg):
  libc = _libc
  if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _become(uid):
  """Drop every privilege: no supplementary groups, gid and uid both the sandbox uid."""
  os.setgroups([])
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)


def _execvp(argv):
  """os.execvp without its lazy `import warnings`, which the sandbox uid cannot read from a
  root-owned Python installation (e.g. under /root/.pyenv)."""
  if "/" in argv[0]:
    os.execv(argv[0], argv)
  error = FileNotFoundError(2, "not found on PATH", argv[0])
  for directory in os.environ.get("PATH", "/usr/bin:/bin").split(":"):
    try:
      os.execv(os.path.join(directory or ".", argv[0]), argv)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
      error = e
  raise error


def _exec_command(spec):
  """In the forked child: isolate, limit and exec; never returns."""
  try:
    os.setsid()
    # Python ignores SIGPIPE and SIGXFSZ; the command gets the defaults, as under a shell.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
      signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    uid = spec["uid"]
    if uid is not None:
      _become(uid)
      # Leftovers of a caller that died hard: the uid is ours now (the caller holds its lock).
      # kill(-1) never signals the calling process itself.
      try:
        os.kill(-1, signal.SIGKILL)
      except ProcessLookupError:
        pass
    # Limits after the uid switch: lowering is always allowed, and RLIMIT_NPROC must count only
    # the sandbox uid (root is exempt from it).
    for name, (soft, hard) in spec["rlimits"].items():
      resource.setrlimit(getattr(resource, name), (soft, hard))
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries (su, ping) cannot regain privileges
    _execvp(spec["argv"])
  except BaseException as e:  # report like a shell would, then die without running cleanup
    try:
      os.write(2, f"sandbox: cannot run {spec['argv'][0]!r}: {e}\n".encode())
    finally:
      os._exit(127)


def _kill_uid(uid):
  """Fork a helper that becomes `uid` and sends SIGKILL to every process of that uid."""
  pid = os.fork()
  if pid == 0:
    try:
      _become(uid)
      os.kill(-1, signal.SIGKILL)
    except BaseException:
      pass
    os._exit(0)


def _direct_children():
  """Our children, from /proc (used only without root, where kill(-1) would hit the caller)."""
  me = str(os.getpid())
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        stat = f.read().decode(errors="replace")
    except OSError:
      continue
    if stat[stat.rindex(")") + 2:].split()[1] == me:  # field 4, after the "(comm)" field
      found.append(int(name))
  return found


def _kill_and_reap(spec, command_pid, statuses):
  """Kill the whole tree and reap it; record the command's status if it shows up."""
  deadline = time.monotonic() + _KILL_GRACE_SECONDS
  while time.monotonic() < deadline:
    if spec["uid"] is not None:
      _kill_uid(spec["uid"])
    else:
      for pid in [command_pid, *_direct_children()]:
        try:
          os.killpg(pid, signal.SIGKILL)
        except OSError:
          pass
        try:
          os.kill(pid, signal.SIGKILL)
        except OSError:
          pass
    retry_at = time.monotonic() + 0.05
    while time.monotonic() < retry_at:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return True
      if pid == command_pid:
        statuses[pid] = status
      elif pid == 0:
        time.sleep(0.002)
  return False


def main():
  spec = _parse_spec(sys.argv[1:])
  # Die with the caller. PDEATHSIG follows the caller's *thread*, which waits for us throughout.
  _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
  if os.getppid() != spec["caller"]:  # the caller died before the prctl took effect
    sys.exit(125)
  _prctl(_PR_SET_CHILD_SUBREAPER, 1)

  def stop(signum, frame):
    raise _Stop()

  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, stop)
  signal.signal(signal.SIGPIPE, signal.SIG_IGN)

  statuses = {}
  command_pid = None
  # Signals wait until command_pid is known, so a SIGTERM right after the fork cannot orphan it.
  stop_signals = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
  signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
  try:
    command_pid = os.fork()
    if command_pid == 0:
      _exec_command(spec)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
    while command_pid not in statuses:
      pid, status = os.waitpid(-1, 0)  # orphans are reaped here as they come
      statuses[pid] = status
  except _Stop:
    pass
  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
  if command_pid is not None and not _kill_and_reap(spec, command_pid, statuses):
    os.write(2, b"sandbox: some processes survived the kill\n")
    sys.exit(126)
  status = statuses.get(command_pid)
  if status is None:
    sys.exit(128 + signal.SIGKILL)
  code = os.waitstatus_to_exitcode(status)
  sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
  main()
