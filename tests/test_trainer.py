"""The one supervised trainer (wmrl/kernel/trainer.py) on a tiny linear model: its LR schedule, the
time-budget stop, exact resume after an interruption, a finished run's report on rerun, and the
optimizer-state codec (with the reader of the older ``opt.`` format)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from wmrl.kernel.checkpoint import (
    load_extra_tensors,
    optimizer_from_tensors,
    optimizer_to_tensors,
)
from wmrl.kernel.trainer import (
    BudgetClock,
    TrainConfig,
    Trainer,
    TrainTask,
    _legacy_optimizer,
    lr_at,
)


class Killed(Exception):
    pass


class LinearTask(TrainTask):
    """y = x @ [1, 2, 3] + noise; batches and noise from one generator (saved for resume)."""

    name = "linear"

    def __init__(self, kill_at: int | None = None):
        torch.manual_seed(0)
        self.module = torch.nn.Linear(3, 1)
        self.gen = torch.Generator().manual_seed(0)
        self.kill_at, self.calls = kill_at, 0

    def batches(self, start, stop):
        for _ in range(start, stop):
            x = torch.randn(8, 3, generator=self.gen)
            yield x, x @ torch.tensor([[1.0], [2.0], [3.0]])

    def loss(self, batch):
        self.calls += 1
        if self.kill_at is not None and self.calls == self.kill_at:
            raise Killed
        x, y = batch
        noise = 0.01 * torch.randn(y.shape, generator=self.gen)
        loss = (self.module(x) - y - noise).pow(2).mean()
        return loss, {"loss": float(loss.detach())}

    def streams(self):
        return {"g": self.gen}

    def checkpoint_config(self):
        return {"_target_": "torch.nn.Linear", "in_features": 3, "out_features": 1}


def cfg(**kw) -> TrainConfig:
    base = {"steps": 12, "lr": 0.05, "warmup": 2, "log_every": 3, "ckpt_every": 4, "tensorboard": False, "progress": False}
    return TrainConfig(**{**base, **kw})


def run(out, task=None, **kw) -> tuple[Trainer, dict | None]:
    tr = Trainer(task or LinearTask(), cfg(**kw), out).run()
    if tr.finished is not None:
        return tr, tr.finished
    report = {"steps": tr.step, "cut": tr.cut, "final_loss": sum(tr.recent) / len(tr.recent)}
    tr.finish(report if tr.step >= tr.cfg.steps or tr.cut else None)
    return tr, report


def test_schedule_warms_up_then_decays_to_the_floor():
    assert [lr_at(s, 10, 1.0, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, 10, 1.0, 4) == 1.0
    assert lr_at(7, 10, 1.0, 4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(10, 10, 1.0, 4) == pytest.approx(0.1) and lr_at(99, 10, 1.0, 4) == pytest.approx(0.1)
    assert lr_at(5, 10, 2.0, 0, min_ratio=0.0, time_frac=1.0) == pytest.approx(0.0, abs=1e-12)
    # the time budget pulls the decay forward when it runs out first, never back
    assert lr_at(5, 100, 1.0, 0, time_frac=0.5) == lr_at(50, 100, 1.0, 0)
    assert lr_at(50, 100, 1.0, 0, time_frac=0.1) == lr_at(50, 100, 1.0, 0)


def test_schedule_equals_both_schedules_it_replaced():
    """The BC (min_lr_ratio, max(1, warmup)) and world-model (floor 0.1) formulas, bit for bit."""
    def bc(step, steps, lr, warmup, mr, tf):
        if step < warmup:
            return lr * (step + 1) / max(1, warmup)
        prog = max((step - warmup) / max(1, steps - warmup), tf)
        return lr * (mr + (1 - mr) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))

    def wm(step, total, lr, warmup, tf):
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = min(1.0, max((step - warmup) / max(1, total - warmup), tf))
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    for step in range(0, 60, 3):
        for tf in (0.0, 0.3, 1.5):
            assert lr_at(step, 50, 3e-4, 7, 0.1, tf) == bc(step, 50, 3e-4, 7, 0.1, tf) == wm(step, 50, 3e-4, 7, tf)
            assert lr_at(step, 50, 1e-3, 5, 0.25, tf) == bc(step, 50, 1e-3, 5, 0.25, tf)


def test_time_budget_stops_the_run_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(BudgetClock, "elapsed", lambda self: 1e6)
    with caplog.at_level(logging.WARNING):
        tr, rep = run(tmp_path, budget_s=10.0)
    assert tr.step == 1 and tr.cut and tr.over and rep["cut"]
    assert "of 12 planned" in caplog.text and "not comparable" in caplog.text
    meta = json.loads((tmp_path / "checkpoints" / "last" / "meta.json").read_text())
    assert meta["step"] == 1 and meta["report"]["cut"]


def test_without_a_budget_the_clock_does_not_stop_it(tmp_path, monkeypatch):
    monkeypatch.setattr(BudgetClock, "elapsed", lambda self: 1e6)
    tr, _ = run(tmp_path)
    assert tr.step == 12 and not tr.cut


def test_interrupted_run_resumes_bitwise_and_a_finished_one_returns_its_report(tmp_path):
    full_task = LinearTask()
    _, full = run(tmp_path / "full", full_task)
    for kill in (6, 3):                              # killed after the step-4 checkpoint, then right after resuming
        with pytest.raises(Killed):
            run(tmp_path / "killed", LinearTask(kill_at=kill))
    resumed_task = LinearTask()
    tr, rep = run(tmp_path / "killed", resumed_task)
    assert tr.resumed is not None and tr.start_step == 4
    assert rep == full
    for a, b in zip(full_task.module.state_dict().values(), resumed_task.module.state_dict().values()):
        assert torch.equal(a, b)
    last = tmp_path / "killed" / "checkpoints" / "last" / "meta.json"
    before = last.stat().st_mtime_ns
    again, rep2 = run(tmp_path / "killed")
    assert again.finished is not None and rep2 == json.loads(json.dumps(full))
    assert last.stat().st_mtime_ns == before
    assert any(k.startswith("opt/0/") for k in load_extra_tensors(tmp_path / "full" / "checkpoints" / "last"))


def _stepped_adamw() -> torch.optim.AdamW:
    torch.manual_seed(1)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return opt


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for pid in sa:
        assert sa[pid].keys() == sb[pid].keys()
        for k in sa[pid]:
            assert torch.equal(torch.as_tensor(sa[pid][k]).float(), torch.as_tensor(sb[pid][k]).float())


def test_optimizer_codec_round_trip():
    opt = _stepped_adamw()
    tensors, meta = optimizer_to_tensors(opt)
    assert all(k.startswith("opt/") and k.count("/") == 2 for k in tensors)
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters(), lr=1e-2)
    optimizer_from_tensors(fresh, tensors, json.loads(json.dumps(meta, default=float)))
    _same_state(opt, fresh)


@pytest.mark.parametrize("fmt", ["bc", "worldmodel"])
def test_older_opt_dot_format_is_still_read(fmt):
    opt = _stepped_adamw()
    tensors, meta = optimizer_to_tensors(opt)
    old = {"opt." + k[4:].replace("/", "."): v for k, v in tensors.items() if not k.endswith("/step")}
    steps = {k[4:].replace("/", "."): float(v) for k, v in tensors.items() if k.endswith("/step")}
    if fmt == "bc":       # policies/train.py: scalars under meta["steps"], no param groups
        old_meta = {"steps": steps}
    else:                 # worldmodels/train.py: tensors only, meta["optimizer"] with "pid.key" scalars
        old = {"opt." + k[4:].replace("/", "."): v for k, v in tensors.items()}
        old_meta = {"optimizer": {"param_groups": meta["param_groups"], "scalars": {}}}
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters(), lr=1e-2)
    new_t, new_m = _legacy_optimizer(old, old_meta, fresh.state_dict()["param_groups"])
    optimizer_from_tensors(fresh, new_t, new_m)
    _same_state(opt, fresh)
