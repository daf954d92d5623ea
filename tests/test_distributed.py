"""Data-parallel training under torchrun (wmrl.kernel.distributed, the one trainer): batch sharding, the
gradient against the one-process gradient of the whole batch, parameters bitwise equal across ranks,
per-rank noise with a common RNG state, rank-0-only writes, a run killed under torchrun that resumes to
the uninterrupted result, and loopback-only sockets while torchrun runs."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from wmrl.kernel.distributed import shard

HERE = Path(__file__).parent


def test_shard_keeps_this_ranks_rows_of_every_batch_sized_leaf():
    @dataclasses.dataclass
    class W:
        frames: torch.Tensor
        step: torch.Tensor
        prev: torch.Tensor | None = None

    b = {"x": torch.arange(8).view(4, 2), "w": W(torch.arange(4), torch.arange(4) * 10), "texts": list("abcd"),
         "const": torch.tensor(3.0), "table": torch.zeros(5, 2)}
    s1 = shard(b, 1, 2)
    assert s1["x"].tolist() == [[4, 5], [6, 7]] and s1["w"].frames.tolist() == [2, 3]
    assert s1["w"].step.tolist() == [20, 30] and s1["w"].prev is None
    assert s1["texts"] == ["c", "d"] and float(s1["const"]) == 3.0 and s1["table"].shape == (5, 2)
    assert shard(b, 0, 1) is b
    with pytest.raises(ValueError, match="not a multiple of the 3 ranks"):
        shard(b, 0, 3)
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        shard({"t": "text"}, 0, 2)


def _loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip.split("%")[0])
    return a.is_loopback or bool(getattr(a, "ipv4_mapped", None) and a.ipv4_mapped.is_loopback)


def _torchrun(out: Path, steps: int, ckpt_every: int, kill_at: int = 0, watch: bool = False):
    """Launch tests/ddp_worker.py on 2 ranks through ``wmrl torchrun``'s launcher; returns (return code, listening sockets seen, output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "wmrl.kernel.distributed", "--nproc-per-node", "2", "--max-restarts", "0",
           str(HERE / "ddp_worker.py"), str(out), str(steps), str(ckpt_every), str(kill_at)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    listening: set = set()
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        if watch:
            try:
                procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    listening |= {(p.pid, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                                  if c.status == psutil.CONN_LISTEN}
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    return proc.wait(), listening, proc.stdout.read()


def test_torchrun_two_ranks_average_the_gradient_stay_equal_and_resume_after_a_kill(tmp_path, monkeypatch):
    import ddp_worker

    a = tmp_path / "a"
    rc, listening, out = _torchrun(a, steps=6, ckpt_every=2, watch=True)
    assert rc == 0, out
    r0, r1 = torch.load(a / "rank0.pt"), torch.load(a / "rank1.pt")
    assert r0["world"] == r1["world"] == 2
    # parameters bitwise equal across ranks; the RNG state common, the loss's noise the rank's own
    assert all(torch.equal(p, q) for p, q in zip(r0["params"], r1["params"]))
    assert torch.equal(r0["gen_state"], r1["gen_state"]) and not torch.equal(r0["noise"], r1["noise"])
    # the averaged gradient of step 1 equals the one-process gradient of the whole batch of 16
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    task = ddp_worker.ToyTask()
    loss, _ = task.loss(task.batch())
    loss.backward()
    err = max(float((g - p.grad).abs().max()) for g, p in zip(r0["grad"], task.module.parameters()))
    assert err <= 1e-6, err
    # rank 0 alone writes: one TensorBoard event file, one report in the final checkpoint
    assert len(list((a / "tb").glob("events.*"))) == 1
    assert (a / "checkpoints" / "last").is_dir()
    # every socket torchrun and the ranks listened on was on loopback
    assert listening, "no listening socket seen while torchrun ran"
    bad = [x for x in listening if not _loopback(x[1])]
    assert not bad, f"sockets listening beyond loopback: {bad}"

    # killed after step 3 (rank 1 SIGKILLed; checkpoints at 2, 4): resumes at 2, ends bitwise as run a
    b = tmp_path / "b_resumed"
    rc, _, out = _torchrun(b, steps=6, ckpt_every=2, kill_at=3)
    assert rc != 0 and not (b / "rank0.pt").exists(), out
    rc, _, out = _torchrun(b, steps=6, ckpt_every=2)
    assert rc == 0, out
    s0 = torch.load(b / "rank0.pt")
    assert s0["start_step"] == 2
    assert all(torch.equal(p, q) for p, q in zip(s0["params"], r0["params"]))


def test_world_model_batches_split_each_sub_batch_and_the_mask_on_its_batch_dimension():
    from worldmodels.data import Windows
    from worldmodels.train import WorldModelTask

    def win(n):
        t = torch.arange(n).float()
        return Windows(frames=t.view(n, 1), proprio=t.view(n, 1), actions=t.view(n, 1, 1), next_frames=t.view(n, 1),
                       next_proprio=t.view(n, 1), episode=t.long(), step=t.long())

    path = {"proprio": torch.arange(6).float().view(6, 1), "actions": torch.arange(6).float().view(6, 1),
            "mask": torch.arange(30).float().view(5, 6)}
    cond = {"anchor_u8": torch.arange(4).view(4, 1), "anchor_proprio": torch.arange(4).float().view(4, 1), "frames": None}
    w, p, (gw, anchor, anchor_p), cond = WorldModelTask.shard(
        None, (win(4), path, (win(8), torch.arange(8), torch.arange(8).float().view(8, 1)), cond), 1, 2)
    assert w.frames.view(-1).tolist() == [2, 3] and w.episode.tolist() == [2, 3]
    assert cond["anchor_u8"].view(-1).tolist() == [2, 3] and cond["anchor_proprio"].view(-1).tolist() == [2, 3]
    assert anchor_p.view(-1).tolist() == [4, 5, 6, 7]
    assert p["proprio"].view(-1).tolist() == [3, 4, 5] and p["mask"].shape == (5, 3)
    assert torch.equal(p["mask"], path["mask"][:, 3:])
    assert gw.step.tolist() == [4, 5, 6, 7] and anchor.tolist() == [4, 5, 6, 7]
