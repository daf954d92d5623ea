"""`wmrl refine`: fine-tune a (tiny) world model on failures recorded by the bridge."""

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from wmrl.kernel.types import PANDA_OSC_POSE
from wmrl.run.common import RunContext

CAMS = {"agentview": (32, 32), "robot0_eye_in_hand": (32, 32)}


def _stores(tmp_path, n_base=6, n_fail=3, T=16):
    from wmrl.kernel.storage import EpisodeStore
    from worldmodels.synthetic import make_episode

    base = EpisodeStore.create(tmp_path / "base", cameras=CAMS, state_dim=9, action_dim=7, fps=20,
                               action_space=PANDA_OSC_POSE, durable=False)
    for i in range(n_base):
        base.append(make_episode(i, T, 32, expert=True))
    fail = EpisodeStore.create(tmp_path / "fail", cameras=CAMS, state_dim=9, action_dim=7, fps=20,
                               action_space=PANDA_OSC_POSE, source="robot_bridge", durable=False)
    ok = make_episode(500, T, 32, expert=True)
    ok.success = True
    fail.append(ok)  # a success in the deployment store: not used for refinement
    for i in range(n_fail):
        e = make_episode(1000 + i, T, 32, expert=False)
        e.success = False
        e.info["failure_label"] = "watchdog" if i == 0 else "timeout"
        fail.append(e)
    return base, fail


def _tiny_wm(tmp_path, base, steps):
    from hydra.utils import instantiate

    from worldmodels.data import EpisodeFrames
    from worldmodels.train import train_world_model

    wm_cfg = OmegaConf.load("configs/worldmodel/tiny.yaml")
    model = instantiate(wm_cfg, _convert_="all")
    cfgd = OmegaConf.to_container(wm_cfg)
    cfgd.pop("_target_")
    train_world_model(model, cfgd, EpisodeFrames.from_store(base, list(range(len(base) - 1))), tmp_path / "wm",
                      steps=steps, batch_size=8, tensorboard=False, progress=False, checkpoint_every=steps,
                      eval_every=steps)
    return tmp_path / "wm" / "checkpoints" / "last"


def _cfg(overrides):
    with initialize_config_module(config_module="configs", version_base="1.3"):
        return compose(config_name="refine", overrides=overrides)


def test_refine_uses_only_failures_and_reports_change(tmp_path):
    from wmrl.run import refine

    base, fail = _stores(tmp_path)
    ck = _tiny_wm(tmp_path, base, steps=4)
    cfg = _cfg([f"worldmodel_checkpoint={ck}", f"store={tmp_path / 'base'}", f"failures_store={tmp_path / 'fail'}",
                "train.steps=4", "train.batch_size=8", "replay_episodes=2", "heldout_every=3", "eval_chunks=1",
                "eval_stride=8", "progress=false", "failure_labels=[timeout]"])
    rep = refine.run(cfg, RunContext(cfg, out_dir=tmp_path / "run"))
    assert rep["failure_episodes"] == [2, 3]  # the success (0) and the watchdog failure (1) are left out
    assert rep["heldout_episodes"] == [2, 5]
    for k in ("failures", "heldout"):
        assert np.isfinite(rep["error_before"][k]) and rep["error_before"][k] > 0
        assert rep["relative_change"][k] == pytest.approx(
            (rep["error_after"][k] - rep["error_before"][k]) / rep["error_before"][k])
    assert (tmp_path / "run" / "worldmodel" / "checkpoints" / "last" / "model.safetensors").is_file()
    json.dumps(rep, default=float)


def test_refine_without_failures_is_a_clear_error(tmp_path):
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run import refine
    from worldmodels.synthetic import make_episode

    base, _ = _stores(tmp_path, n_fail=0)
    ck = _tiny_wm(tmp_path, base, steps=2)
    only_ok = EpisodeStore.create(tmp_path / "ok", cameras=CAMS, state_dim=9, action_dim=7, fps=20,
                                  action_space=PANDA_OSC_POSE, durable=False)
    e = make_episode(1, 16, 32)
    e.success = True
    only_ok.append(e)
    cfg = _cfg([f"worldmodel_checkpoint={ck}", f"store={tmp_path / 'base'}", f"failures_store={tmp_path / 'ok'}"])
    with pytest.raises(ValueError, match="no failed episode"):
        refine.run(cfg, RunContext(cfg, out_dir=tmp_path / "run"))


@pytest.mark.slow
def test_refine_lowers_error_on_failures(tmp_path):
    from wmrl.run import refine

    torch.manual_seed(0)
    base, fail = _stores(tmp_path, n_base=10, n_fail=4, T=24)
    ck = _tiny_wm(tmp_path, base, steps=60)
    cfg = _cfg([f"worldmodel_checkpoint={ck}", f"store={tmp_path / 'base'}", f"failures_store={tmp_path / 'fail'}",
                "train.steps=60", "train.batch_size=16", "replay_episodes=4", "progress=false"])
    rep = refine.run(cfg, RunContext(cfg, out_dir=tmp_path / "run"))
    assert rep["relative_change"]["failures"] < 0
