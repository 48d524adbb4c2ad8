"""The Ray backend: engines and environment workers as Ray actors, same contract as ThreadBackend.

    backend = RayBackend(worker_spec, env_workers=8, engines=2)   # starts a local Ray if none
    backend.start(version)                      # actors built; engines load `version`
    future = backend.submit(rollout_spec, task) # concurrent.futures.Future[Rollout]
    backend.load_version(v); backend.engine_version(); backend.stats(); backend.close()
    # or through the config: c2.rl.backends.make_backend("ray", spec, env_workers=8, engines=2)

Actors (threaded, built from the picklable WorkerSpec with the code of c2/rl/workers.py):
  EngineActor  an EngineHost; every env worker's request in flight is a concurrent `generate`
               call (the EngineWorker thread batches them), beside control calls.
  EnvWorker    `rollouts_per_env_worker` rollouts at a time, each `run_task` with a `generate`
               that calls an engine actor; `env_workers` rollouts in flight in all.

Faults. A killed or crashed actor fails its calls with RayActorError. An env worker turns an
engine's death into WorkerDiedError (the rollout fails); the driver turns an env worker's death
into WorkerDiedError too, so the coordinator sees one exception type and retries. Dead actors are
replaced before the next submit (engines at the newest version asked for), not restarted by Ray:
a replacement is a fresh actor, and Ray's own restarts would hide the count in `stats()`.

Ray is imported here only, so the rest of c2 runs without it (the `rl` extra of setup.py).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import re
import threading
import time
from typing import Any, Optional

import jax
import ray
from ray import exceptions as ray_errors

import c2
from c2.envs.tasks import Task
from c2.rl.backends import Backend
from c2.rl.rollout import Rollout, RolloutSpec
from c2.rl.workers import EngineHost, WorkerDiedError, WorkerSpec, load_worker_tokenizer, run_task

ENGINE_CONCURRENCY = 64  # generate calls in flight at least (one per env rollout)
VERSION_CACHE_S = 0.5  # engine_version() is polled by the coordinator's pump loop
QUERY_TIMEOUT_S = 2.0  # a busy or starting actor answers later; use what we last knew


# Control calls get threads of their own: behind a full pool of generate calls, engine_version()
# would time out and a weight load would wait for a free slot.
@ray.remote(max_concurrency=ENGINE_CONCURRENCY, concurrency_groups={"control": 4})
class EngineActor:
  """An EngineHost in its own process; calls arrive on Ray's thread pools."""

  def __init__(self, spec: WorkerSpec, version: int):
    self.host = EngineHost(spec, version)

  def generate(self, request):
    return self.host.generate(request)

  @ray.method(concurrency_group="control")
  def load_version(self, version: int) -> None:
    self.host.load_version(version)

  @ray.method(concurrency_group="control")
  def version(self) -> int:
    return self.host.version

  @ray.method(concurrency_group="control")
  def stats(self) -> dict:
    return self.host.stats()


@ray.remote
class EnvWorker:
  """Runs rollouts (sandboxed environments) against an engine actor given per rollout."""

  def __init__(self, spec: WorkerSpec):
    self.spec = spec
    self.tokenizer = load_worker_tokenizer(spec)

  def ping(self) -> bool:
    return True

  def run(self, rollout: RolloutSpec, task: Task, engine) -> Rollout:
    def generate(request):
      try:
        return ray.get(engine.generate.remote(request))
      except ray_errors.RayActorError as e:  # ActorDiedError, ActorUnavailableError
        raise WorkerDiedError(f"engine actor died during {request.id}: {e}") from None
      except ray_errors.RayTaskError as e:  # e.g. the EngineHost's own WorkerDiedError
        raise WorkerDiedError(f"engine failed {request.id}: {e.cause!r}") from None
    return run_task(self.spec, rollout, task, generate, self.tokenizer)


def actor_env_vars() -> dict[str, str]:
  """The actors' environment: c2 importable; the driver's JAX platform and matmul precision (an
  engine actor computes as an in-process engine would); the driver's XLA_FLAGS, which reach the
  actors through the raylet, less the tests' fake device count (an engine uses one device)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(c2.__file__)))
  xla_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                     os.environ.get("XLA_FLAGS", ""))
  env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
         "XLA_FLAGS": " ".join(xla_flags.split())}
  if jax.default_backend() == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
  precision = jax.config.jax_default_matmul_precision
  if precision is not None:
    env["JAX_DEFAULT_MATMUL_PRECISION"] = str(precision)
  return env


@dataclasses.dataclass
class _Actor:
  handle: Any
  version: int = 0  # engines: the version it last reported (or was built at)
  in_flight: int = 0  # env workers: rollouts running on it
  dead: bool = False  # killed, or seen dead: replaced at the next submit
  suspect: bool = False  # a rollout using it failed: ping it at the next submit


class RayBackend(Backend):
  """See the module docstring. `engine_options` are extra `.options()` for engine actors (e.g.
  {"num_gpus": 1} or custom resources on a cluster)."""

  def __init__(self, spec: WorkerSpec, *, env_workers: int, engines: int = 1,
               rollouts_per_env_worker: int = 1, ray_address: Optional[str] = None,
               engine_options: Optional[dict] = None):
    if env_workers < 1 or engines < 1 or rollouts_per_env_worker < 1:
      raise ValueError(f"env_workers={env_workers}, engines={engines}, "
                       f"rollouts_per_env_worker={rollouts_per_env_worker}: each must be >= 1")
    self.spec, self.num_engines = spec, engines
    self.rollouts_per_env_worker = rollouts_per_env_worker
    self.num_env_workers = -(-env_workers // rollouts_per_env_worker)
    self._owns_ray = False
    if not ray.is_initialized():
      # A local instance unless an address is given; the dashboard would cost seconds and a port.
      kwargs = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
      if ray_address is None and not os.environ.get("RAY_ADDRESS"):
        kwargs["num_cpus"] = max(os.cpu_count() or 1, engines)
      ray.init(address=ray_address, **kwargs)
      self._owns_ray = True
    env = {"env_vars": actor_env_vars()}
    self._engine_cls = EngineActor.options(**{
        "num_cpus": 1, "runtime_env": env, "max_concurrency": max(ENGINE_CONCURRENCY, env_workers),
        **(engine_options or {})})
    # Env workers wait on the engine and on sandbox subprocesses: no CPU reserved.
    self._env_cls = EnvWorker.options(num_cpus=0, runtime_env=env,
                                      max_concurrency=rollouts_per_env_worker + 2)
    self._engines: list[_Actor] = []
    self._envs: list[_Actor] = []
    self._lock = threading.Lock()
    self._pending: dict[int, concurrent.futures.Future] = {}
    self._keys = itertools.count()
    self._engine_turn = itertools.count()
    self._env_turn = itertools.count()
    self._version = 0
    self._version_cache = (-1.0, 0)  # (time, value)
    self.restarts = {"engine": 0, "env": 0}

  # ----------------------------------------------------------------------------------- lifecycle
  def start(self, version: int) -> None:
    """Builds every actor and waits until they are up (a bad spec fails here, not per rollout)."""
    self._version = version
    self._engines = [self._new_engine() for _ in range(self.num_engines)]
    self._envs = [self._new_env() for _ in range(self.num_env_workers)]
    ray.get([e.handle.version.remote() for e in self._engines] +
            [e.handle.ping.remote() for e in self._envs])

  def _new_engine(self) -> _Actor:
    return _Actor(self._engine_cls.remote(self.spec, self._version), version=self._version)

  def _new_env(self) -> _Actor:
    return _Actor(self._env_cls.remote(self.spec))

  def close(self) -> None:
    with self._lock:
      actors, self._engines, self._envs = self._engines + self._envs, [], []
      pending, self._pending = list(self._pending.values()), {}
    for actor in actors:
      _kill(actor.handle)
    for future in pending:
      _settle(future, exception=WorkerDiedError("RayBackend closed"))
    if self._owns_ray:
      ray.shutdown()

  # ---------------------------------------------------------------------------------- rollouts
  def submit(self, spec: RolloutSpec, task: Task) -> concurrent.futures.Future:
    with self._lock:
      if not self._engines:
        raise RuntimeError("RayBackend.start(version) first")
      self._replace_dead()
      engine = self._engines[next(self._engine_turn) % len(self._engines)]
      # Least loaded env worker, ties broken round-robin (all equal when each runs one rollout).
      turn = next(self._env_turn)
      order = [self._envs[(turn + i) % len(self._envs)] for i in range(len(self._envs))]
      env = min(order, key=lambda a: a.in_flight)
      env.in_flight += 1
      key = next(self._keys)
      future: concurrent.futures.Future = concurrent.futures.Future()
      self._pending[key] = future
      ref = env.handle.run.remote(spec, task, engine.handle)
    ref.future().add_done_callback(lambda done: self._finish(key, done, env, engine))
    return future

  def _finish(self, key: int, done: concurrent.futures.Future, env: _Actor,
              engine: _Actor) -> None:
    """On Ray's callback thread: settle the caller's future, noting which actor may be dead."""
    error = done.exception()
    if isinstance(error, ray_errors.RayActorError):  # the env worker itself died
      error = WorkerDiedError(f"env worker died: {error}")
      env.dead = True
    elif isinstance(error, ray_errors.RayTaskError):  # run() raised: unwrap the worker's error
      error = error.cause if isinstance(error.cause, Exception) else RuntimeError(str(error))
      if isinstance(error, WorkerDiedError):
        engine.suspect = True
    with self._lock:
      env.in_flight -= 1
      future = self._pending.pop(key, None)
    if future is not None:
      if error is None:
        _settle(future, result=done.result())
      else:
        _settle(future, exception=error)

  def _replace_dead(self) -> None:
    """Under the lock: replaces actors known dead, and pings suspects (a rollout on them failed)
    to find out. Replacements start at once; their first calls queue until they are up."""
    for actor in self._engines:
      if actor.suspect and not actor.dead:
        actor.dead = not _alive(actor.handle.version.remote())
      actor.suspect = False
    for i, actor in enumerate(self._engines):
      if actor.dead:
        _kill(actor.handle)
        self._engines[i] = self._new_engine()
        self.restarts["engine"] += 1
    for i, actor in enumerate(self._envs):
      if actor.dead:
        _kill(actor.handle)
        self._envs[i] = self._new_env()
        self.restarts["env"] += 1

  # ----------------------------------------------------------------------------------- versions
  def load_version(self, version: int) -> None:
    with self._lock:
      self._version = max(self._version, version)
      engines = [e for e in self._engines if not e.dead]
    for engine in engines:
      engine.handle.load_version.remote(version)  # not awaited: engines swap between steps
    self._version_cache = (-1.0, 0)

  def engine_version(self) -> int:
    asked_at, cached = self._version_cache
    if time.monotonic() - asked_at < VERSION_CACHE_S:
      return cached
    with self._lock:
      engines = list(self._engines)
    refs = [(e, e.handle.version.remote()) for e in engines if not e.dead]
    for engine, ref in refs:
      try:
        engine.version = ray.get(ref, timeout=QUERY_TIMEOUT_S)
      except ray_errors.GetTimeoutError:
        pass  # busy or still starting: it holds at least what it last reported
      except ray_errors.RayActorError:
        engine.dead = True
    # A dead engine's replacement will start at the newest version asked for.
    versions = [self._version if e.dead else e.version for e in engines]
    value = min(versions) if versions else self._version
    self._version_cache = (time.monotonic(), value)
    return value

  def stats(self) -> dict:
    with self._lock:
      engines = [e for e in self._engines if not e.dead]
    per_engine = []
    for ref in [e.handle.stats.remote() for e in engines]:
      try:
        per_engine.append(ray.get(ref, timeout=QUERY_TIMEOUT_S))
      except (ray_errors.GetTimeoutError, ray_errors.RayActorError):
        continue
    out: dict = {}
    for name in sorted({k for s in per_engine for k in s}):
      values = [s[name] for s in per_engine if name in s]
      if name == "engine/tokens_per_sec":
        out[name] = sum(values)
      elif name == "engine/version":
        out[name] = min(values)
      else:  # rates (MTP acceptance, prefix reuse): the mean over engines
        out[name] = sum(values) / len(values)
    out.update({"workers/engine_restarts": self.restarts["engine"],
                "workers/env_restarts": self.restarts["env"],
                "workers/engines": len(self._engines), "workers/env_workers": len(self._envs)})
    return out

  # ------------------------------------------------------------------------------ fault injection
  def kill_engine(self) -> None:
    with self._lock:
      live = [e for e in self._engines if not e.dead]
      if not live:
        return
      live[0].dead = True
    _kill(live[0].handle)

  def kill_env_worker(self) -> None:
    """Kills the busiest env worker (one with a rollout in flight if any); every rollout it held
    fails with WorkerDiedError."""
    with self._lock:
      live = [e for e in self._envs if not e.dead]
      if not live:
        return
      victim = max(live, key=lambda a: a.in_flight)
      victim.dead = True
    _kill(victim.handle)


def _alive(ref) -> bool:
  try:
    ray.get(ref, timeout=QUERY_TIMEOUT_S)
  except ray_errors.RayActorError:
    return False
  except ray_errors.GetTimeoutError:
    pass  # busy, not dead
  return True


def _kill(handle) -> None:
  try:
    ray.kill(handle, no_restart=True)
  except Exception:  # pylint: disable=broad-except
    pass  # already gone, or Ray is shutting down


def _settle(future: concurrent.futures.Future, *, result=None, exception=None) -> None:
  """Sets a caller's future unless it was cancelled meanwhile."""
  try:
    if exception is not None:
      future.set_exception(exception)
    else:
      future.set_result(result)
  except concurrent.futures.InvalidStateError:
    pass
