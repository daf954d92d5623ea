"""worldmodels.dynamics.ProprioDynamics: shapes, the commanded-target prior, learning, bad input;
``wmrl bench dynamics`` end to end on a tiny setting."""

from __future__ import annotations

import json

import pytest
import torch

from wmrl.kernel.types import PANDA_EE_YAW, PANDA_OSC_POSE
from worldmodels.dynamics import ProprioDynamics


def _state(b):
    s = torch.zeros(b, 9)
    s[:, :3] = torch.tensor([0.45, 0.0, 0.1])
    s[:, 3] = 1.0
    s[:, 7], s[:, 8] = 0.02, -0.02
    return s


def test_rollout_shapes_and_the_commanded_target_prior():
    torch.manual_seed(0)
    m = ProprioDynamics(PANDA_EE_YAW, ensemble=3, hidden=32)
    s0 = _state(2)
    a = torch.zeros(2, 5, 5)
    a[..., :3] = s0[:, None, :3] + torch.tensor([0.02, 0.0, 0.0])
    out = m.rollout(s0, a)
    assert out.shape == (3, 2, 5, 9) and m.disagreement(out).shape == (2, 5)
    # untrained, the residual is small: the arm is near the commanded target after one step
    assert (out[:, :, 0, :3] - a[None, :, 0, :3]).abs().max() < 0.01
    far = a.clone()
    far[..., 0] += 0.5  # clipped to the 5 cm box around the arm
    assert (m.commanded(s0[:, :3], far[:, 0]) - s0[:, :3])[:, 0].allclose(torch.full((2,), 0.05))
    d = ProprioDynamics(PANDA_OSC_POSE, ensemble=1, hidden=8)
    assert d.commanded(s0[:, :3], torch.ones(2, 7)).allclose(s0[:, :3] + 0.05)
    assert d.disagreement(d.rollout(s0, torch.zeros(2, 3, 7))).abs().max() == 0


def test_the_unrolled_loss_trains_the_ensemble():
    torch.manual_seed(0)
    m = ProprioDynamics(PANDA_EE_YAW, ensemble=2, hidden=32)
    # a "real" arm that reaches only 60 % of the way to each target: the prior alone is wrong
    s = _state(16)
    s[:, 0] += torch.rand(16) * 0.05
    prev, states, acts = s.clone(), [s.clone(), s.clone()], []
    for _ in range(6):
        a = torch.cat([s[:, :3] + 0.03 * torch.randn(16, 3), torch.zeros(16, 1), -torch.ones(16, 1)], -1)
        s = s.clone()
        s[:, :3] = s[:, :3] + 0.6 * (a[:, :3] - s[:, :3])
        acts.append(a)
        states.append(s)
    batch = {"proprio": torch.stack(states, 1), "actions": torch.stack(acts, 1), "mask": torch.ones(2, 16)}
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    first = m.loss(batch)[0].item()
    for _ in range(150):
        loss, metrics = m.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first and metrics["end_pos_err_cm"] < 0.5


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="state_dim"):
        ProprioDynamics(PANDA_EE_YAW, state_dim=7)
    with pytest.raises(ValueError, match="ensemble"):
        ProprioDynamics(PANDA_EE_YAW, ensemble=0)
    with pytest.raises(ValueError, match="mode"):
        ProprioDynamics({**PANDA_EE_YAW.to_dict(), "mode": "velocity"})


def test_bench_dynamics_reports_every_horizon_and_the_gate(tmp_path):
    from wmrl.run.bench_dynamics import run
    from wmrl.run.common import RunContext
    from wmrl.run.stages import compose_stage_config

    cfg = compose_stage_config("bench_dynamics", {"episodes_per_task": 2, "holdout_every": 2, "max_chunks": 3,
                                                  "batch_size": 8, "model": {"ensemble": 2, "hidden": 16},
                                                  "train": {"steps": 5, "warmup": 1, "progress": False}},
                               groups=["suite=tiny"])
    report = run(cfg, RunContext(cfg, out_dir=tmp_path))
    assert report["control"] == "osc_delta" and report["episodes"] == {"train": 2, "held_out": 2}
    h1 = report["horizons"][1]
    assert h1["model"]["count"] > 0 and set(h1) == {"model", "copy", "commanded", "disagreement"}
    assert isinstance(report["gate2"]["passes"], bool) and (tmp_path / "paths.png").is_file()
    json.dumps(report)
