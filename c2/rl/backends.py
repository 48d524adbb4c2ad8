"""Where rollouts run. One interface, two backends with the same worker code (c2/rl/workers.py):

  ThreadBackend  (embedded default) one engine on its own thread and `env_workers` environment
                 threads, in the learner's process.
  RayBackend     (c2/rl/ray_backend.py) engine and environment workers as Ray actors, for
                 several hosts; the same submit/result contract.

    backend = ThreadBackend(worker_spec, env_workers=8)
    backend.start(version)                      # engines load `version` from the weight store
    future = backend.submit(rollout_spec, task) # concurrent.futures.Future[Rollout]
    backend.load_version(v)                     # engines swap weights in mid-rollout
    backend.engine_version()                    # the oldest version any engine still samples with

A dead worker (`kill_engine` / `kill_env_worker`, used by the fault tests, or a real crash) fails
the futures of the rollouts it held with WorkerDiedError and is replaced before the next submit;
the coordinator (c2/rl/coordinator.py) decides to retry or drop those rollouts and counts them.
"""
from __future__ import annotations

import abc
import concurrent.futures
import threading
from typing import Optional

from c2.envs.tasks import Task
from c2.rl.rollout import Rollout, RolloutSpec
from c2.rl.workers import EngineHost, WorkerDiedError, WorkerSpec, load_worker_tokenizer, run_task


class Backend(abc.ABC):
  """Runs rollouts; see the module docstring."""

  @abc.abstractmethod
  def start(self, version: int) -> None:
    ...

  @abc.abstractmethod
  def submit(self, spec: RolloutSpec, task: Task) -> concurrent.futures.Future:
    ...

  @abc.abstractmethod
  def load_version(self, version: int) -> None:
    """Asks every engine to take `version` from the weight store (does not wait)."""

  @abc.abstractmethod
  def engine_version(self) -> int:
    """The version the engines sample with now (the lowest, if they differ)."""

  @abc.abstractmethod
  def stats(self) -> dict:
    ...

  @abc.abstractmethod
  def kill_engine(self) -> None:
    """Fault injection: the engine worker dies as if it crashed."""

  @abc.abstractmethod
  def kill_env_worker(self) -> None:
    """Fault injection: an environment worker with a rollout in flight dies."""

  @abc.abstractmethod
  def close(self) -> None:
    ...


class ThreadBackend(Backend):
  """The in-process backend: an EngineHost and a pool of environment threads."""

  def __init__(self, spec: WorkerSpec, *, env_workers: int = 8):
    self.spec, self.env_workers = spec, env_workers
    self.tokenizer = load_worker_tokenizer(spec)
    self._pool = concurrent.futures.ThreadPoolExecutor(env_workers, thread_name_prefix="env")
    self._engine: Optional[EngineHost] = None
    self._lock = threading.Lock()
    self._running: dict[int, threading.Event] = {}  # rollout key -> "this worker died" flag
    self._keys = iter(range(1 << 62))
    self._version = 0
    self.restarts = {"engine": 0, "env": 0}

  def start(self, version: int) -> None:
    self._version = version
    self._engine = EngineHost(self.spec, version)

  def _current_engine(self) -> EngineHost:
    with self._lock:
      if self._engine is None:
        raise RuntimeError("ThreadBackend.start(version) first")
      if self._engine.dead.is_set():  # replace a dead engine, at the newest version asked for
        self._engine = EngineHost(self.spec, self._version)
        self.restarts["engine"] += 1
      return self._engine

  def submit(self, spec: RolloutSpec, task: Task) -> concurrent.futures.Future:
    died = threading.Event()
    key = next(self._keys)
    with self._lock:
      self._running[key] = died

    def generate(request):
      if died.is_set():
        raise WorkerDiedError(f"environment worker of {spec} died")
      return self._current_engine().generate(request)

    def job() -> Rollout:
      try:
        rollout = run_task(self.spec, spec, task, generate, self.tokenizer)
        if died.is_set():  # killed after its last engine call: the result died with the worker
          raise WorkerDiedError(f"environment worker of {spec} died")
        return rollout
      finally:
        with self._lock:
          self._running.pop(key, None)

    return self._pool.submit(job)

  def load_version(self, version: int) -> None:
    self._version = max(self._version, version)
    engine = self._current_engine()
    threading.Thread(target=engine.load_version, args=(version,), daemon=True).start()

  def engine_version(self) -> int:
    engine = self._engine
    if engine is None or engine.dead.is_set():
      return self._version
    return engine.version

  def stats(self) -> dict:
    engine = self._engine
    out = dict(engine.stats()) if engine is not None else {}
    out.update({"workers/engine_restarts": self.restarts["engine"],
                "workers/env_restarts": self.restarts["env"]})
    return out

  def kill_engine(self) -> None:
    with self._lock:
      engine = self._engine
    if engine is not None:
      engine.kill()

  def kill_env_worker(self) -> None:
    """The rollout a thread holds fails at its next engine call (or at its end, if it makes no
    more), as if its process had died; the thread itself returns to the pool (the replacement
    worker)."""
    with self._lock:
      if not self._running:
        return
      key = min(self._running)
      self._running[key].set()
      self.restarts["env"] += 1

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)
    if self._engine is not None:
      self._engine.close()


def make_backend(kind: str, spec: WorkerSpec, *, env_workers: int, engines: int = 1) -> Backend:
  if kind == "threads":
    return ThreadBackend(spec, env_workers=env_workers)
  if kind == "ray":
    from c2.rl import ray_backend  # pylint: disable=import-outside-toplevel
    return ray_backend.RayBackend(spec, env_workers=env_workers, engines=engines)
  raise ValueError(f"rl.backend={kind!r}; choose threads or ray")
