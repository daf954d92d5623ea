"""Data-parallel training under ``torchrun`` for the one trainer (:mod:`wmrl.kernel.trainer`).

    wmrl torchrun --nproc-per-node 2 train-policy store=runs/demos hydra.run.dir=runs/bc_ddp   # one machine
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\
        -m wmrl.cli train-worldmodel store=... hydra.run.dir=runs/wm                          # a cluster

``wmrl torchrun`` (:func:`launch`) is torchrun (``torch.distributed.run``) on one machine with every
socket on loopback: torchrun's own stores listen on all interfaces (``TCPStore`` binds ``::``), so the
launcher hosts the rendezvous store itself on ``127.0.0.1`` (a pre-bound socket handed to
``TCPStore(master_listen_fd=...)``), tells torchrun to join it (``--rdzv-backend c10d
--rdzv-conf is_host=false --local-addr 127.0.0.1``) and not to share an agent store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), so rank 0's trainer hosts the trainers' store, which
:func:`init_from_env` binds to loopback the same way; the gloo pairs bind to ``lo``
(``GLOO_SOCKET_IFNAME``). It also sets ``OMP_WAIT_POLICY=PASSIVE`` and one thread per rank unless
given. Plain ``torchrun`` works too (multi-node: it must listen beyond loopback).

``torchrun`` sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
:func:`init_from_env` joins the process group they describe (gloo on CPU, nccl when CUDA is there; the
rank's GPU is ``cuda:LOCAL_RANK``). Without ``WORLD_SIZE`` (or with ``WORLD_SIZE=1``) nothing starts
and every function here is the single-process identity, so the same code runs with and without it.

How a step is split (:class:`DataParallel`; the scheme is the one of ``torch.nn.parallel.
DistributedDataParallel``: the gradient of the mean loss over the global batch is the mean of the
ranks' gradients, all-reduced before the optimizer step, so every rank takes the same step):

* every rank draws the **same global batch** (same seed, same generators) and keeps its own rows
  (:func:`shard`, rows ``r*B/W .. (r+1)*B/W - 1`` of every batch-sized tensor); the batch size in the
  config is the effective batch whatever the number of ranks, and the RNG state is the same on every
  rank, so rank 0's checkpoint resumes all of them;
* the randomness *inside* the loss (flow-matching noise and times, dropout) is drawn per rank: before
  the loss every torch generator of the task and the default generator are re-seeded from their
  common state and the rank, and after it they are all moved to one common next state, so ranks do
  not draw the same noise for different rows and still agree on the state a checkpoint records;
* gradients (and the logged loss) are summed in one flat all-reduce and divided by ``W``; a
  parameter without a gradient on every rank keeps none (as AdamW skips it in one process);
* rank 0 alone writes checkpoints, TensorBoard and the progress bar; a time budget stops every rank
  at the same step (the stop flag is all-reduced).

With a loss that draws no random numbers, the averaged gradient equals the single-process gradient
of the concatenated batch to float rounding (``tests/test_distributed.py``: <= 1e-6), and the
parameters stay bitwise equal across ranks.

Raises:
    ValueError: a batch whose size is not a multiple of ``WORLD_SIZE``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import logging
import os
import socket
import sys
from typing import Any

import numpy as np
import torch

log = logging.getLogger("wmrl.distributed")


def world_size() -> int:
    """Ranks of the running group, else ``WORLD_SIZE`` from the environment (1 without torchrun)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


def rank() -> int:
    """This process's rank (0 without torchrun)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def is_main() -> bool:
    """Whether this process writes (rank 0, or no group)."""
    return rank() == 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def loopback_store(port: int, world: int, is_server: bool, timeout_s: float = 300.0):
    """A ``torch.distributed.TCPStore`` on ``127.0.0.1:port``; as the server it listens on loopback
    only (a socket bound here and handed over as ``master_listen_fd``), as a client it connects.
    ``port=0`` with ``is_server``: a free port (read it from ``.port``)."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_server:
        return torch.distributed.TCPStore("127.0.0.1", port, world, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(256)
    store = torch.distributed.TCPStore("127.0.0.1", sock.getsockname()[1], world, True, timeout,
                                       wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.detach())
    return store


def init_from_env() -> bool:
    """Join the process group ``torchrun`` describes; idempotent. Returns ``True`` when a group with
    more than one rank is running.

    On CPU the backend is gloo; when ``MASTER_ADDR`` is a loopback address and ``GLOO_SOCKET_IFNAME``
    is unset it is set to ``lo``, so the gloo pairs bind to loopback like the store. On CUDA the
    backend is nccl and the rank's device ``cuda:LOCAL_RANK`` is made current.

    Raises:
        RuntimeError: ``WORLD_SIZE > 1`` without ``MASTER_ADDR`` / ``MASTER_PORT`` (not launched by
            torchrun: launch with ``torchrun --nproc-per-node N``).
    """
    dist = torch.distributed
    if dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return False
    if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR / MASTER_PORT are unset: launch wmrl with "
                           "`torchrun --nproc-per-node N --master-addr 127.0.0.1 -m wmrl.cli ...`")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
        if _is_loopback(os.environ["MASTER_ADDR"]):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE" and torch.get_num_threads() > 1:
        log.warning("OMP_WAIT_POLICY is not PASSIVE: with more than one thread per rank OpenMP spin-waits "
                    "and ranks sharing cores run up to 10x slower (export OMP_WAIT_POLICY=PASSIVE)")
    ws, rk = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    own_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if own_store and _is_loopback(os.environ["MASTER_ADDR"]):
        # rank 0 hosts the trainers' store: bind it to loopback (a plain env:// init binds all interfaces)
        store = loopback_store(int(os.environ["MASTER_PORT"]), ws, is_server=rk == 0)
        dist.init_process_group(backend=backend, store=store, rank=rk, world_size=ws)
    else:
        dist.init_process_group(backend=backend)
    log.info("torch.distributed: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)
    return dist.get_world_size() > 1


def barrier() -> None:
    """Wait for every rank (no-op without a group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (a picklable object; identity without a group). Used for
    small values of wmrl's own making (a run directory), never for data read from a file."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def launch(argv: list[str], commands: frozenset[str] | set[str] = frozenset()) -> int:
    """``wmrl torchrun [torchrun options] <wmrl subcommand | -m module | script> [args]``: torchrun on
    this machine with every socket on loopback (module docstring). Options before the command go to
    torchrun (default ``--nproc-per-node 2``); ``--nnodes`` other than 1 is refused (use torchrun with
    a reachable rendezvous endpoint for several machines). A first word in ``commands`` (the ``wmrl``
    CLI passes its subcommands) runs as ``-m wmrl.cli <word>``. Returns torchrun's exit status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    opts, i = [], 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        opt = argv[i]
        if "=" not in opt and i + 1 < len(argv) and not opt.startswith(("--standalone", "--no-python", "--run-path")):
            opts += [opt, argv[i + 1]]
            i += 2
        else:
            opts.append(opt)
            i += 1
    rest = argv[i:]
    if not rest:
        raise ValueError("usage: wmrl torchrun [--nproc-per-node N] <wmrl subcommand> [key=value ...]")
    if rest[0] in commands:           # a wmrl subcommand (``commands``: the CLI's table)
        rest = ["-m", "wmrl.cli", *rest]
    joined = " ".join(opts)
    if any(k in joined for k in ("--nnodes", "--rdzv", "--master", "--standalone", "--local-addr")):
        raise ValueError(f"wmrl torchrun runs one machine on loopback and sets the rendezvous itself; got {joined!r}: "
                         "for several machines call torchrun directly (docs/architecture.md, Scale)")
    if not any(o.startswith("--nproc") for o in opts):
        opts = ["--nproc-per-node", "2", *opts]
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    store = loopback_store(0, 1, is_server=True)
    args = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
            "--rdzv-conf", "is_host=false", "--local-addr", "127.0.0.1", *opts, *rest]
    log.info("torchrun %s", " ".join(args))
    try:
        torchrun.main(args)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except ChildFailedError as e:    # a rank failed (its traceback is printed above)
        log.error("%s", e)
        return 1
    finally:
        del store
    return 0


# ---------------------------------------------------------------------------- sharding
def _batch_size(batch) -> int | None:
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, dict):
        items = batch.values()
    elif isinstance(batch, (list, tuple)) and not (batch and isinstance(batch[0], str)):
        items = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    else:
        return None
    for v in items:
        n = _batch_size(v)
        if n is not None:
            return n
    return None


def _take(x, n: int, lo: int, hi: int):
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x[lo:hi] if x.ndim and x.shape[0] == n else x
    if isinstance(x, dict):
        return {k: _take(v, n, lo, hi) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        if len(x) == n and x and isinstance(x[0], str):     # per-row texts (instructions)
            return list(x[lo:hi]) if isinstance(x, list) else tuple(x[lo:hi])
        out = [_take(v, n, lo, hi) for v in x]
        return out if isinstance(x, list) else type(x)(out) if not hasattr(x, "_fields") else type(x)(*out)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _take(getattr(x, f.name), n, lo, hi)
                                         for f in dataclasses.fields(x) if f.init})
    return x


def shard(batch, rank_: int, world: int, what: str = "batch"):
    """This rank's rows of ``batch``: in every tensor / array whose first dimension is the batch size
    ``B`` (the first such dimension found), and in every list of ``B`` strings, rows
    ``rank*B/world .. (rank+1)*B/world - 1``; other leaves (scalars, per-batch constants) are kept.
    Nested dicts, lists, tuples and dataclasses are walked.

    Raises:
        ValueError: ``B`` is not a multiple of ``world``, or no batch dimension is found.
    """
    if world <= 1:
        return batch
    n = _batch_size(batch)
    if n is None:
        raise ValueError(f"cannot split the {what} over {world} ranks: no tensor with a batch dimension in it")
    if n % world:
        raise ValueError(f"the {what} size {n} is not a multiple of the {world} ranks: make the batch size a "
                         f"multiple of WORLD_SIZE (the config's batch size is the effective batch over all ranks)")
    per = n // world
    return _take(batch, n, rank_ * per, (rank_ + 1) * per)


# ---------------------------------------------------------------------------- the step
def _seed_from(state: torch.Tensor, salt: str) -> int:
    h = hashlib.blake2b(state.numpy().tobytes(), digest_size=8, person=b"wmrl-ddp")
    h.update(salt.encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


class DataParallel:
    """The collective part of one data-parallel training step (see the module docstring).

    Args:
        params: the parameters the optimizer updates, in the same order on every rank.

    Use: :meth:`broadcast_params` once before training (rank 0's weights everywhere); per step
    ``with dp.rank_rng(streams): loss = task.loss(shard(batch))``, ``loss.backward()``, then
    :meth:`all_reduce_grads` before clipping and the optimizer step.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)
        self.world, self.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()

    def broadcast_params(self, modules: list[torch.nn.Module]) -> None:
        """Rank 0's parameters and buffers on every rank (after init or resume)."""
        with torch.no_grad():
            for m in modules:
                for t in list(m.parameters()) + list(m.buffers()):
                    torch.distributed.broadcast(t.data, src=0)

    class _RankRng:
        def __init__(self, dp: DataParallel, gens: list[torch.Generator]):
            self.dp, self.gens = dp, gens

        def __enter__(self):
            self.states = [g.get_state() for g in self.gens] + [torch.get_rng_state()]
            for g, s in zip(self.gens, self.states):
                g.manual_seed(_seed_from(s, f"rank{self.dp.rank}"))
            torch.manual_seed(_seed_from(self.states[-1], f"rank{self.dp.rank}"))
            return self

        def __exit__(self, *exc):
            # one common next state on every rank, a function of the common state before the step
            for g, s in zip(self.gens, self.states):
                g.manual_seed(_seed_from(s, "next"))
            torch.manual_seed(_seed_from(self.states[-1], "next"))
            return False

    def rank_rng(self, streams: dict) -> DataParallel._RankRng:
        """Context in which the task's torch generators (``streams`` values that are
        ``torch.Generator``) and the default generator draw this rank's own numbers."""
        return self._RankRng(self, [g for g in streams.values() if isinstance(g, torch.Generator)])

    def all_reduce_grads(self, loss_value: float) -> float:
        """Average the gradients of :attr:`params` over the ranks (one flat all-reduce, which also
        carries the loss value and which parameters have a gradient on some rank; those without one
        anywhere keep ``grad=None``). Returns the loss averaged over the ranks."""
        ps = self.params
        dev = ps[0].device if ps else torch.device("cpu")
        has = torch.tensor([p.grad is not None for p in ps], dtype=torch.float32, device=dev)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in ps]
                         + [has, torch.tensor([float(loss_value)], device=dev)])
        torch.distributed.all_reduce(flat)
        flat /= self.world
        anywhere = flat[-1 - len(ps):-1] > 0
        i = 0
        for j, p in enumerate(ps):
            n = p.numel()
            if bool(anywhere[j]):
                g = flat[i:i + n].view_as(p).to(p.dtype)
                p.grad = g.clone() if p.grad is None else p.grad.copy_(g)
            i += n
        return float(flat[-1])

    def any_flag(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (e.g. a time budget that ran out)."""
        t = torch.tensor([1.0 if flag else 0.0])
        torch.distributed.all_reduce(t)
        return bool(t.item() > 0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(launch(sys.argv[1:]))
