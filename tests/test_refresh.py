"""World model in the loop (wmrl.refresh.WorldModelRefresher) with the real parts at tiny sizes: the
current policy's real-sim rollouts are recorded, the world model and critic are fine-tuned in place
(without re-fitting their normalisation), each round is saved and a new refresher restores it."""

import json

import numpy as np
import pytest
import torch


def _compose(name, overrides):
    from hydra import compose, initialize_config_module

    with initialize_config_module("configs", version_base="1.3"):
        return compose(name, overrides=overrides)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from hydra.utils import instantiate

    from sim.suite import Suite
    from wmrl.imagination import ImaginationEnv
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run import collect
    from wmrl.run.common import RunContext
    from worldmodels.data import EpisodeFrames
    from worldmodels.train import fit_world_model_stats

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("refresh")
    store = tmp / "store.zarr"
    # the delta space, as the world model, policy and Suite below (refresh does not depend on the space)
    cfg = _compose("collect", ["suite=tiny", "suite.control=null", "tasks=[lift_red]", "episodes_per_task=5", "noise=0.3",
                               f"out={store}"])
    collect.run(cfg, RunContext(cfg, out_dir=tmp / "collect"))
    st = EpisodeStore.open(store)
    data = EpisodeFrames([st.episode(i) for i in range(len(st))], cameras=["agentview", "robot0_eye_in_hand"])
    torch.manual_seed(0)
    wm_cfg = _compose("train_worldmodel", ["worldmodel=tiny", "store=x"]).worldmodel
    cr_cfg = _compose("train_critic", ["critic=tiny", "store=x"]).critic
    wm = instantiate(wm_cfg, _convert_="all")
    fit_world_model_stats(wm, data)
    critic = instantiate(cr_cfg, _convert_="all")
    critic.set_norm_stats(torch.from_numpy(data.proprio))
    from policies.flow_vla import FlowVLAPolicy
    from policies.samplers import SDESampler

    policy = FlowVLAPolicy(image_size=[32, 32], chunk_size=4, encoder={"kind": "conv", "channels": [8, 16], "out_dim": 16},
                           lang_dim=16, proprio_dim=8, cond_dim=32, head_width=32, head_depth=1, time_dim=16,
                           sampler=SDESampler(4, 0.5))
    policy.set_norm_stats(st.stats())
    suite = Suite(tasks=["lift_red"], image_size=(32, 32))
    env = ImaginationEnv(wm.eval(), critic.eval(), num_envs=2, max_chunks=2)
    from omegaconf import OmegaConf

    return dict(store=store, env=env, policy=policy.eval(), suite=suite, tmp=tmp,
                wm_cfg=OmegaConf.to_container(wm_cfg), cr_cfg=OmegaConf.to_container(cr_cfg))


def _refresher(p, out, **kw):
    from wmrl.refresh import RefreshConfig, WorldModelRefresher
    from worldmodels.train import RefreshFineTunes

    return WorldModelRefresher(p["env"], p["suite"].make_env(2), {"lift_red": "lift the red cube"}, out, p["store"],
                               p["wm_cfg"], p["cr_cfg"], RefreshFineTunes(),
                               RefreshConfig(n_init=10, episodes_per_task=2, max_steps=12, replay_episodes=3,
                                             wm_seconds=1.5, critic_seconds=1.0, wm_batch_size=4, critic_batch_size=8,
                                             bank_size=8, bank_chunks=1, progress=False), **kw)


def test_refresh_round_fine_tunes_in_place_and_restores(parts):
    from wmrl.kernel.storage import EpisodeStore

    p = parts
    wm, critic = p["env"].world_model, p["env"].critic
    before_wm = {k: v.clone() for k, v in wm.state_dict().items()}
    before_cr = {k: v.clone() for k, v in critic.state_dict().items()}
    out = p["tmp"] / "refresh"
    r = _refresher(p, out)
    assert len(r.replay) == 3  # training-split episodes only (5 episodes, heldout_every=5: 4 train)
    stats = r(p["policy"], 3)
    # the current policy's real rollouts are recorded (2 starts of lift_red, at most 12 steps each)
    ro = EpisodeStore.open(out / "round_0003" / "rollouts.zarr")
    assert len(ro) == 2 and all(1 <= n <= 12 for n in ro.lengths)
    assert ro.episode(0).info["source"] == "grpo_refresh" and ro.episode(0).info["split"] == "train"
    assert stats["refresh/episodes"] == 2 and 0.0 <= stats["refresh/real_success"] <= 1.0
    assert stats["refresh/worldmodel_steps"] >= 1 and stats["refresh/critic_steps"] >= 1
    # both modules were fine-tuned in place; normalisation statistics were kept
    changed = [k for k, v in wm.state_dict().items() if not torch.equal(v, before_wm[k])]
    assert any("unet" in k for k in changed)
    assert torch.equal(wm.proprio_mean, before_wm["proprio_mean"]) and torch.equal(wm.proprio_std, before_wm["proprio_std"])
    assert any(not torch.equal(v, before_cr[k]) for k, v in critic.state_dict().items())
    assert not wm.training and not critic.training
    latest = json.loads((out / "latest.json").read_text())
    assert latest["iteration"] == 3 and len(latest["rollout_stores"]) == 1
    # a new refresher (a resumed run) restores the round's weights and its on-policy episodes
    after = {k: v.clone() for k, v in wm.state_dict().items()}
    wm.load_state_dict(before_wm)
    r2 = _refresher(p, out)
    assert r2.restore() == 3
    assert all(torch.equal(v, after[k]) for k, v in wm.state_dict().items())
    assert len(r2.onpolicy) == 2 and np.array_equal(r2.onpolicy[1].actions, ro.episode(1).actions)
    # rollouts of a later round start from other init states than this one's (fresh draw per round)
    assert [s.init_index for s in r.starts(3)] != [s.init_index for s in r.starts(6)]


def test_refresh_needs_an_imagination_env(parts):
    from wmrl.refresh import WorldModelRefresher

    p = parts
    with pytest.raises(ValueError, match="env=imagination"):
        WorldModelRefresher(p["suite"].make_env(2), p["suite"].make_env(2), {"lift_red": "x"}, p["tmp"] / "r",
                            p["store"], p["wm_cfg"], p["cr_cfg"], object())
