"""The host side of a sandbox: where workspaces live, private uids, lending a workspace to one,
and the disk quota.

Split from c2/envs/sandbox.py, which explains the design: each command runs as a uid of its own,
UID_BASE + slot for a free slot, so that RLIMIT_NPROC (counted per uid, system-wide, ignored for
root) is a per-sandbox budget and killing every process of the uid kills the whole tree. A slot is
held with flock on a file under $TMPDIR/c2-sandbox-uids, which excludes other threads (each open
is its own lock) and other processes alike, and is released on close, even if the holder crashes.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import random
import shutil
import stat
import tempfile
import threading
from typing import Callable, Sequence

UID_BASE = 1_500_000_000  # far above real accounts and the usual subuid ranges (100000-165535)
UID_SLOTS = 1024
SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable: rlimits mode may write there
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


def workspace_parent() -> pathlib.Path:
  """Where workspaces live by default: a directory that every sandbox uid may traverse (0711)."""
  path = pathlib.Path(tempfile.gettempdir()) / "c2-workspaces"
  path.mkdir(mode=0o711, exist_ok=True)
  st = path.lstat()
  if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
    raise RuntimeError(f"{path} is not a directory owned by us; remove it")
  os.chmod(path, 0o711)
  return path


def command_aliases() -> pathlib.Path:
  """A world-readable directory put first on every sandboxed PATH, with `python` -> python3:
  Debian ships only `python3`, while task test commands and model-written commands say `python`.
  Under bwrap it is bound read-only at the same path."""
  path = workspace_parent() / ".bin"
  path.mkdir(mode=0o755, exist_ok=True)
  python = path / "python"
  target = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "/usr/bin/python3"
  if not python.is_symlink() or os.readlink(python) != target:
    temporary = path / f".python.{os.getpid()}.{threading.get_ident()}"
    temporary.unlink(missing_ok=True)
    os.symlink(target, temporary)
    os.replace(temporary, python)  # atomic: concurrent sandboxes never see it missing
  return path


def check_lendable(root: pathlib.Path, uid_switch: bool) -> None:
  """Refuse directories that must not be handed to a sandbox, or that its uid cannot reach."""
  if not root.is_dir():
    raise NotADirectoryError(f"workspace {root} is not a directory")
  protected = {pathlib.Path(p) for p in (*SYSTEM_DIRS, *SHARED_TMP_DIRS, "/root", "/home")}
  if root in protected or any(p.is_relative_to(root) for p in protected):  # "/" included
    raise ValueError(f"workspace {root} is a system directory; refusing to give it to a sandbox")
  if uid_switch:
    for parent in root.parents:
      if not os.stat(parent).st_mode & stat.S_IXOTH:
        raise PermissionError(
            f"workspace {root}: the sandbox uid cannot reach it because {parent} is not searchable "
            f"by others; `chmod o+x {parent}` or put workspaces under {workspace_parent()}")


@contextlib.contextmanager
def lease_uid(preferred: int):
  """Hold one sandbox uid for the duration; `preferred` (the workspace's owner) saves chowns."""
  lock_dir = pathlib.Path(tempfile.gettempdir()) / "c2-sandbox-uids"
  lock_dir.mkdir(mode=0o700, exist_ok=True)
  first = preferred - UID_BASE
  if not 0 <= first < UID_SLOTS:
    first = random.randrange(UID_SLOTS)
  for i in range(UID_SLOTS):
    slot = (first + i) % UID_SLOTS
    fd = os.open(lock_dir / f"{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      continue
    try:
      yield UID_BASE + slot
    finally:
      os.close(fd)  # releases the flock
    return
  raise RuntimeError(f"all {UID_SLOTS} sandbox uids are busy")


def chown_tree(root: pathlib.Path, uid: int, gid: int) -> None:
  """lchown everything under root (never following links); hardlinked files stay as they are."""
  os.lchown(root, uid, gid)
  stack = [str(root)]
  while stack:
    with os.scandir(stack.pop()) as entries:
      for entry in entries:
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
          stack.append(entry.path)
        elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
          continue
        if st.st_uid != uid or st.st_gid != gid:
          os.lchown(entry.path, uid, gid)


def uid_leftovers(uid: int, keep: pathlib.Path) -> list[pathlib.Path]:
  """Entries of the shared temp dirs owned by uid (rlimits mode writes there), except `keep`."""
  found = []
  for shared in SHARED_TMP_DIRS:
    with contextlib.suppress(OSError), os.scandir(shared) as entries:
      for entry in entries:
        with contextlib.suppress(OSError):
          if entry.stat(follow_symlinks=False).st_uid == uid:
            found.append(pathlib.Path(entry.path))
  return [path for path in found if not keep.is_relative_to(path)]


def remove(path: pathlib.Path) -> None:
  """Delete a leftover without following it if it is a link (rmtree itself never follows)."""
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      path.unlink()


def disk_usage(paths: Sequence[os.PathLike]) -> tuple[int, int]:
  """(allocated bytes, entries) under paths, not following symlinks."""
  total, count = 0, 0
  stack = [os.fspath(p) for p in paths]
  while stack:
    path = stack.pop()
    try:
      st = os.lstat(path)
    except OSError:
      continue
    total, count = total + st.st_blocks * 512, count + 1
    if stat.S_ISDIR(st.st_mode):
      with contextlib.suppress(OSError), os.scandir(path) as entries:
        stack.extend(entry.path for entry in entries)
  return total, count - len(paths)


class DiskWatch:
  """A disk quota at the cost of one statvfs per poll: the paths are walked only when the free space
  of their file systems fell by enough since the last walk that the quota could be exceeded."""

  def __init__(self, paths_fn: Callable[[], list[pathlib.Path]], filesystems: Sequence[str],
               max_bytes: int, max_files: int):
    self._paths_fn = paths_fn
    devices = {}
    for path in filesystems:
      with contextlib.suppress(OSError):
        devices.setdefault(os.stat(path).st_dev, path)
    self._filesystems = list(devices.values())
    self._measure()
    # A workspace already over quota (an earlier breach) may not grow, but a command may clean up.
    self._max_bytes = max(max_bytes, self.used_bytes)
    self._max_files = max(max_files, self.used_files)

  def _free(self) -> tuple[int, int]:
    free_bytes = free_files = 0
    for path in self._filesystems:
      s = os.statvfs(path)
      free_bytes, free_files = free_bytes + s.f_bavail * s.f_frsize, free_files + s.f_favail
    return free_bytes, free_files

  def _measure(self) -> None:
    self.used_bytes, self.used_files = disk_usage(self._paths_fn())
    self._free_at_measure = self._free()

  def breach(self) -> str | None:
    """Why the command must stop now, or None."""
    free_bytes, free_files = self._free()
    could_use_bytes = self.used_bytes + max(0, self._free_at_measure[0] - free_bytes)
    could_use_files = self.used_files + max(0, self._free_at_measure[1] - free_files)
    if could_use_bytes <= self._max_bytes and could_use_files <= self._max_files:
      return None
    self._measure()
    if self.used_bytes > self._max_bytes:
      return f"disk quota ({self.used_bytes} > {self._max_bytes} bytes)"
    if self.used_files > self._max_files:
      return f"disk quota ({self.used_files} > {self._max_files} entries)"
    return None
