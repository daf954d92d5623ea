"""The worker engine: Ray for ``workers > 1``, and processes that die with their parent.

:func:`worker_pool` is the one engine everything that steps environments in parallel uses
(collection, evaluation, :class:`RayChunkEnv` for GRPO in the sim): a :class:`RayPool`, the
``concurrent.futures`` subset ``submit(fn, *args) -> future.result()`` over Ray tasks of one CPU
each. Where the cluster is comes from :func:`configure` (the ``ray.address`` key every command has,
set by ``wmrl.run.common.RunContext``):

* ``ray.address=null`` (default): a local Ray cluster, started on first use (2-3 s) and shut down
  at exit, with ``num_cpus`` = this machine's cores. It is hermetic: every socket on loopback
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray otherwise advertises and binds a routable address
  even when told 127.0.0.1; a test checks the listening sockets), no usage reporting, token
  authentication off (Ray 2.60 would write a token under ``~/.ray``), its session files under
  ``$TMPDIR/wmrl-ray-<pid>-*`` (never ``~``), removed at exit. An explicit address is always given
  to ``ray.init``, so a stale ``/tmp/ray/ray_current_cluster`` never makes a run join an old cluster.
* ``ray.address=auto`` or ``HOST:PORT``: join an existing cluster (``ray start --head`` on one node,
  ``ray start --address=...`` on the others); the tasks go wherever Ray places them.

Results never depend on the engine or on the number and placement of workers: the callers deal
their work in a fixed order and merge the results in that order (see ``wmrl.evaluation`` and
``wmrl.run.collect``). Ray kills its task workers when the driver dies, even by ``SIGKILL``; two
idle agents of a killed driver's local cluster (Ray's ``DashboardAgent`` and ``RuntimeEnvAgent``)
outlive it, and the next local start reaps them and their session folder.

The same for ``wmrl`` commands run as child processes (``wmrl bench bridge`` starts ``wmrl serve``
and ``wmrl robot``): start them with ``env=child_env()``; ``wmrl.cli`` calls
:func:`die_with_parent_from_env` first thing, so a killed benchmark leaves no policy server behind.
``PR_SET_PDEATHSIG`` fires when the *thread* that started the child ends: start children from a
thread that lives as long as they should (the main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Worker initializer: arrange to be killed when ``parent`` (the pool's creator) dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:       # the parent died before prctl took effect
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="wmrl-parent-watch").start()


PARENT_ENV = "WMRL_DIE_WITH_PARENT"


def child_env(env: dict | None = None) -> dict:
    """``env`` (default ``os.environ``) plus ``WMRL_DIE_WITH_PARENT=<this pid>``: the environment
    for a ``wmrl`` command that must die with this process (see :func:`die_with_parent_from_env`)."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent_from_env() -> None:
    """In a ``wmrl`` command started with :func:`child_env`: get ``SIGKILL`` when the parent dies
    (exit now if it is gone already). The variable is removed, so this command's own children do
    not inherit it. Started through a wrapper (e.g. a shell), it dies with the wrapper."""
    pid = os.environ.pop(PARENT_ENV, "")
    if not pid.isdigit():
        return
    parent = int(pid)
    if os.getppid() != parent:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os._exit(1)  # the parent died before this command got here
        parent = os.getppid()  # a wrapper between us: die with it
    _die_with_parent(parent)


# ---------------------------------------------------------------------------- Ray

RAY_VERSION = "2.60.0"   # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is internal: pinned in pyproject.toml, checked by a socket test
LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",   # loopback only (see the module docstring)
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",                # no token written under ~/.ray
}
_TMP_PREFIX = "wmrl-ray-"
_engine: dict = {"address": None, "num_cpus": None}
_local: dict = {"tmp": None}


def configure(address: str | None = None, num_cpus: int | None = None) -> None:
    """Where :func:`worker_pool` runs its tasks: ``address`` ``None`` / ``"local"`` (a local
    cluster of ``num_cpus`` CPUs, default all cores), ``"auto"`` or ``"HOST:PORT"`` (an existing
    cluster). Takes effect at the next start of Ray in this process.

    Raises:
        ValueError: an empty or malformed address, or ``num_cpus < 1``.
    """
    if address in ("", "local"):
        address = None
    if address is not None and address != "auto" and ":" not in str(address):
        raise ValueError(f"ray.address must be null (a local cluster), 'auto' or HOST:PORT, got {address!r}")
    if num_cpus is not None and int(num_cpus) < 1:
        raise ValueError(f"ray.num_cpus must be >= 1, got {num_cpus}")
    _engine.update(address=None if address is None else str(address),
                   num_cpus=None if num_cpus is None else int(num_cpus))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_local_clusters(tmp_root: str | None = None) -> list[str]:
    """Remove the session folders of local clusters whose driver is gone (``wmrl-ray-<pid>-*`` in
    ``tmp_root``, default ``$TMPDIR``) and kill the Ray processes still holding files there (a
    ``SIGKILL``-ed driver's agents). Returns the folders removed."""
    import shutil
    import tempfile
    from pathlib import Path

    root = Path(tmp_root or tempfile.gettempdir())
    removed = []
    for d in root.glob(_TMP_PREFIX + "*"):
        parts = d.name[len(_TMP_PREFIX):].split("-", 1)
        if not parts[0].isdigit() or _pid_alive(int(parts[0])):
            continue
        prefix = str(d) + os.sep
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if any(os.readlink(fd).startswith(prefix) for fd in (proc / "fd").iterdir()):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


def _shutdown_local() -> None:
    import shutil
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    if _local["tmp"]:
        shutil.rmtree(_local["tmp"], ignore_errors=True)
        _local["tmp"] = None


def ray_init():
    """The ``ray`` module, connected to the cluster :func:`configure` names (started here when
    local). Idempotent.

    Raises:
        RuntimeError: ``ray`` is not installed, or was imported before the local-cluster settings
            could be applied (import it only through this function).
    """
    import atexit
    import sys
    import tempfile

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return sys.modules["ray"]
    local = _engine["address"] is None
    if local:
        already = "ray" in sys.modules
        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
        if already:
            from ray._private import ray_constants

            if ray_constants.ENABLE_RAY_CLUSTER:
                raise RuntimeError("ray was imported before wmrl.kernel.workers.ray_init could keep a local "
                                   "cluster on loopback: import ray only through ray_init()")
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a dependency
        raise RuntimeError(f"workers > 1 needs Ray (pip install ray=={RAY_VERSION}): {e}") from e
    if local:
        reap_stale_local_clusters()
        tmp = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-")
        _local["tmp"] = tmp
        ray.init(address="local", num_cpus=_engine["num_cpus"] or os.cpu_count(), include_dashboard=False,
                 _temp_dir=tmp, configure_logging=False, log_to_driver=True, logging_level="warning")
        atexit.register(_shutdown_local)
    else:
        ray.init(address=_engine["address"], configure_logging=False, log_to_driver=True, logging_level="warning")
    return ray


class _RayFuture:
    def __init__(self, ray, ref):
        self._ray, self.ref = ray, ref

    def result(self):
        """The task's return value; the task's own exception (Ray wraps it as an instance of the
        same type) when it raised."""
        return self._ray.get(self.ref)


class RayPool:
    """``workers`` Ray tasks at a time, one CPU and one torch thread each, behind the
    ``concurrent.futures`` subset the callers use (``submit``, ``future.result()``, ``with``).
    Leaving the ``with`` block early (an exception) cancels the tasks still running."""

    def __init__(self, workers: int):
        if int(workers) < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = int(workers)
        self._ray = ray_init()
        self._refs: list = []

    def submit(self, fn, *args, **kwargs) -> _RayFuture:
        task = self._ray.remote(num_cpus=1, max_retries=0)(_in_worker)
        ref = task.remote(fn, args, kwargs)
        self._refs.append(ref)
        return _RayFuture(self._ray, ref)

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            for r in self._refs:
                try:
                    self._ray.cancel(r, force=True)
                except Exception:  # noqa: BLE001 - a finished task cannot be cancelled
                    pass


def _in_worker(fn, args, kwargs):
    """A Ray task's body: one torch thread (Ray sets ``OMP_NUM_THREADS`` from ``num_cpus``), then ``fn``."""
    import torch

    torch.set_num_threads(1)
    return fn(*args, **kwargs)


def worker_pool(workers: int) -> RayPool:
    """The engine for ``workers`` parallel workers: a :class:`RayPool` on the configured cluster."""
    return RayPool(workers)


# ------------------------------------------------------------------ a ChunkEnv on Ray actors

class _EnvActor:
    """One Ray actor's share of a :class:`RayChunkEnv`: ``make_env(num_envs)`` and its calls."""

    def __init__(self, make_env, num_envs: int, index: int | None = None):
        import torch

        torch.set_num_threads(1)
        self.env = make_env(int(num_envs)) if index is None else make_env(int(num_envs), int(index))

    def describe(self) -> dict:
        e = self.env
        return {"num_envs": int(e.num_envs), "action_dim": int(e.action_dim),
                "action_space": getattr(e, "action_space", None),
                "methods": [m for m in RayChunkEnv.SLOT_METHODS if callable(getattr(e, m, None))]}

    def reset(self, starts):
        return self.env.reset(list(starts))

    def reset_slots(self, slots, starts):
        return self.env.reset_slots(list(slots), list(starts))

    def step(self, actions):
        return self.env.step(actions)

    def call(self, name: str, slot: int, *args):
        return getattr(self.env, name)(slot, *args)


def _cat_obs(parts):
    import torch

    from wmrl.kernel.types import Obs

    return Obs(images={c: torch.cat([p.images[c] for p in parts]) for c in parts[0].images},
               proprio=torch.cat([p.proprio for p in parts]), task=[t for p in parts for t in p.task])


def _cat_info(parts, offsets):
    """Merge the shards' ``StepResult.info`` along the batch: tensors and ``Obs`` concatenated, lists
    joined, ``{slot: value}`` dicts re-keyed to the whole batch's slots.

    Raises:
        TypeError: a value of another type (the merge would have to guess).
    """
    import torch

    from wmrl.kernel.types import Obs

    out = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        v0 = vals[0]
        if isinstance(v0, torch.Tensor):
            out[key] = torch.cat(vals)
        elif isinstance(v0, Obs):
            out[key] = _cat_obs(vals)
        elif isinstance(v0, list):
            out[key] = [x for v in vals for x in v]
        elif isinstance(v0, dict):
            out[key] = {int(s) + off: x for v, off in zip(vals, offsets) for s, x in v.items()}
        else:
            raise TypeError(f"RayChunkEnv cannot merge info[{key!r}] of type {type(v0).__name__} across its actors")
    return out


class RayChunkEnv:
    """A ``ChunkEnv`` (``wmrl.kernel.interfaces``) whose ``num_envs`` slots are split over ``workers``
    Ray actors, each running ``make_env(b_k)`` for its contiguous share ``b_k`` (sizes differ by at
    most one); ``reset`` / ``reset_slots`` / ``step`` run on all shares at once and their results are
    concatenated in slot order. With slots that do not interact (``sim.env.SimEnv``: one scene per
    slot) the results equal one ``make_env(num_envs)`` bit for bit, so GRPO in the sim gives the same
    update with any number of rollout workers (tested).

    Slot methods of the inner env (``sim_state``, ``privileged``, ``elapsed``, ``record``,
    ``take_frames``) are forwarded to the slot's actor when the inner env has them (declared by the
    inner env, read once at start: an env without ``sim_state`` does not gain the ``SimStateEnv``
    capability here).

    Args:
        make_env: picklable ``num_envs -> ChunkEnv`` (e.g. ``functools.partial`` of a module function
            or a bound ``Suite.make_env``); with ``indexed``: ``(num_envs, actor index) -> ChunkEnv``
            (e.g. world-model replicas, each with its own sampling seed).
        num_envs: ``B`` (>= ``workers``).
        workers: Ray actors (one CPU each, on the cluster :func:`configure` names).
        num_gpus: GPUs per actor (Ray sets its ``CUDA_VISIBLE_DEVICES``, so ``cuda:0`` in the actor
            is its own GPU); 0 on CPU.
        indexed: pass the actor's index to ``make_env``.

    Raises:
        ValueError: ``workers < 1`` or ``num_envs < workers``; ``step`` with a wrong batch.
    """

    SLOT_METHODS = ("sim_state", "privileged", "elapsed", "record", "take_frames")

    def __init__(self, make_env, num_envs: int, workers: int, num_gpus: float = 0.0, indexed: bool = False):
        num_envs, workers = int(num_envs), int(workers)
        if workers < 1 or num_envs < workers:
            raise ValueError(f"RayChunkEnv needs 1 <= workers <= num_envs, got workers={workers}, num_envs={num_envs}")
        self._ray = ray_init()
        self.num_envs, self.workers = num_envs, workers
        sizes = [num_envs // workers + (k < num_envs % workers) for k in range(workers)]
        self._offsets = [sum(sizes[:k]) for k in range(workers)]
        self._sizes = sizes
        actor = self._ray.remote(num_cpus=1, num_gpus=float(num_gpus), max_restarts=0)(_EnvActor)
        self._actors = [actor.remote(make_env, b, k if indexed else None) for k, b in enumerate(sizes)]
        desc = self._ray.get([a.describe.remote() for a in self._actors])
        if [d["num_envs"] for d in desc] != sizes:
            raise ValueError(f"make_env gave envs of {[d['num_envs'] for d in desc]} slots, asked for {sizes}")
        self.action_dim = desc[0]["action_dim"]
        self.action_space = desc[0]["action_space"]
        for m in desc[0]["methods"]:
            setattr(self, m, self._slot_method(m))
        self._obs: list = [None] * workers

    def _where(self, slot: int) -> tuple[int, int]:
        if not 0 <= int(slot) < self.num_envs:
            raise ValueError(f"slot {slot} out of range for num_envs={self.num_envs}")
        k = max(i for i, off in enumerate(self._offsets) if off <= int(slot))
        return k, int(slot) - self._offsets[k]

    def _slot_method(self, name: str):
        def call(slot: int, *args):
            k, j = self._where(slot)
            return self._ray.get(self._actors[k].call.remote(name, j, *args))

        call.__name__ = name
        call.__doc__ = f"The inner env's ``{name}(slot, ...)`` on the actor holding ``slot``."
        return call

    def _split(self, xs):
        return [xs[off:off + b] for off, b in zip(self._offsets, self._sizes)]

    def reset(self, starts):
        if len(starts) != self.num_envs:
            raise ValueError(f"reset needs {self.num_envs} starts (one per slot), got {len(starts)}")
        self._obs = self._ray.get([a.reset.remote(s) for a, s in zip(self._actors, self._split(list(starts)))])
        return _cat_obs(self._obs)

    def reset_slots(self, slots, starts):
        if len(slots) != len(starts):
            raise ValueError(f"reset_slots got {len(slots)} slots and {len(starts)} starts")
        per: dict[int, tuple[list, list]] = {}
        for s, st in zip(slots, starts):
            k, j = self._where(s)
            per.setdefault(k, ([], []))[0].append(j)
            per[k][1].append(st)
        refs = {k: self._actors[k].reset_slots.remote(js, sts) for k, (js, sts) in per.items()}
        for k, obs in zip(refs, self._ray.get(list(refs.values()))):
            self._obs[k] = obs
        if any(o is None for o in self._obs):
            raise RuntimeError("RayChunkEnv.reset_slots before reset: call reset(starts) first")
        return _cat_obs(self._obs)

    def step(self, actions):
        import torch

        from wmrl.kernel.types import StepResult

        if actions.ndim != 3 or actions.shape[0] != self.num_envs:
            raise ValueError(f"RayChunkEnv.step expects actions (B={self.num_envs}, H, D_a), got {tuple(actions.shape)}")
        a = actions.detach().cpu() if isinstance(actions, torch.Tensor) else torch.as_tensor(actions)
        res = self._ray.get([act.step.remote(x) for act, x in zip(self._actors, self._split(a))])
        self._obs = [r.obs for r in res]
        return StepResult(obs=_cat_obs(self._obs), reward=torch.cat([r.reward for r in res]),
                          terminated=torch.cat([r.terminated for r in res]),
                          truncated=torch.cat([r.truncated for r in res]),
                          success=torch.cat([r.success for r in res]),
                          steps_executed=torch.cat([r.steps_executed for r in res]),
                          info=_cat_info([r.info for r in res], self._offsets))

    def close(self) -> None:
        """End the actors (also at exit with the cluster)."""
        for a in self._actors:
            self._ray.kill(a)
        self._actors = []


class _ProcessActor:
    """One Ray actor that runs one command (see :class:`RayProcess`)."""

    def __init__(self):
        self.proc = None

    def start(self, args: list[str], cwd: str, env: dict, log_path: str) -> int:
        import subprocess

        log_file = open(log_path, "w")  # noqa: SIM115 - the command's log; the process holds it until it exits
        # the command dies with this actor (wmrl.cli calls die_with_parent_from_env first thing)
        self.proc = subprocess.Popen(args, cwd=cwd, env={**env, PARENT_ENV: str(os.getpid())}, stdout=log_file,
                                     stderr=subprocess.STDOUT)
        log_file.close()
        return self.proc.pid

    def poll(self):
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class RayProcess:
    """A ``wmrl`` command run as a child of a one-CPU Ray actor, on the node Ray places it (with
    ``ray.address=auto`` any node of the cluster): the part of ``subprocess.Popen`` a supervisor uses,
    ``pid`` (on that node), ``poll()`` (``None`` while it runs, else its exit status; ``-9`` when the
    actor itself is gone) and ``kill()``. Used for environments that run in another Python
    environment (the LIBERO env workers in ``.venv-libero``); the command dies with its actor.

    Args:
        args: the command line; ``cwd``, ``env``: its directory and environment; ``log_path``: its
            stdout and stderr (a path the node can write: shared storage on a cluster).
        this_node: place the actor on this driver's node (for a command that talks to a server
            listening on this node's loopback).
    """

    def __init__(self, args: list[str], cwd: str, env: dict, log_path: str, this_node: bool = False):
        self._ray = ray_init()
        opts: dict = {"num_cpus": 1, "max_restarts": 0}
        if this_node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                self._ray.get_runtime_context().get_node_id(), soft=False)
        self._actor = self._ray.remote(**opts)(_ProcessActor).remote()
        self.pid = int(self._ray.get(self._actor.start.remote([str(a) for a in args], str(cwd), dict(env), str(log_path))))

    def poll(self):
        try:
            return self._ray.get(self._actor.poll.remote())
        except self._ray.exceptions.RayActorError:
            return -9

    def kill(self) -> None:
        try:
            self._ray.get(self._actor.kill.remote())
        except self._ray.exceptions.RayActorError:
            pass
        self._ray.kill(self._actor)
