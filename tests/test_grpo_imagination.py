"""GRPO with the project's real parts, no simulator: the tiny flow-matching VLA (SDE sampler) in an
ImaginationEnv built from a tiny world model and critic, starting from keyframes of toy episodes.
Checks the ratio is exactly 1 at unchanged parameters and that an iteration updates the policy."""

import math

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from policies.flow_vla import FlowVLAPolicy
    from policies.samplers import SDESampler
    from wmrl.imagination import ImaginationEnv
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.kernel.types import PANDA_OSC_POSE
    from wmrl.rl.starts import starts_from_store
    from worldmodels.critic import ProgressValueCritic
    from worldmodels.data import EpisodeFrames
    from worldmodels.synthetic import make_episodes
    from worldmodels.train import fit_world_model_stats
    from worldmodels.video_wm import ChunkFlowWorldModel

    eps = make_episodes(6, length=24, size=32)
    store = EpisodeStore.create(tmp_path_factory.mktemp("s") / "toy.zarr", cameras={"agentview": (32, 32),
                                "robot0_eye_in_hand": (32, 32)}, state_dim=9, action_dim=7, fps=20,
                                action_space=PANDA_OSC_POSE)
    for e in eps:
        store.append(e)
    torch.manual_seed(0)
    pol = FlowVLAPolicy(image_size=[32, 32], chunk_size=4, encoder={"kind": "conv", "channels": [8, 16], "out_dim": 16},
                        lang_dim=16, proprio_dim=8, cond_dim=32, head_width=32, head_depth=1, time_dim=16,
                        sampler=SDESampler(4, 0.5))
    pol.set_norm_stats(store.stats())
    pol.eval()
    wm = ChunkFlowWorldModel(image_size=32, chunk_size=4, block_out_channels=[16, 32], patch=2, proprio_hidden=32,
                             norm_num_groups=8, autocast_bf16=False)
    fit_world_model_stats(wm, EpisodeFrames(eps))
    torch.nn.init.normal_(wm.unet.conv_out.weight, std=0.05)  # untrained: make actions change the frames
    critic = ProgressValueCritic(image_size=32, channels=[8, 16], hidden=32, text_encoder="none")
    critic.set_norm_stats(torch.from_numpy(np.concatenate([e.proprio for e in eps])))
    env = ImaginationEnv(wm.eval(), critic.eval(), num_envs=8, max_chunks=3, seed=0)
    starts = starts_from_store(store, 2, np.random.default_rng(0), min_steps_left=8)
    return pol, env, starts


def test_real_policy_ratio_is_one_and_iteration_updates(parts):
    from wmrl import rl as grpo

    pol, env, starts = parts
    cfg = grpo.GRPOConfig(group_size=4, max_chunks=3, epochs=1, minibatch_size=64, reward_mode="return")
    gen = torch.Generator().manual_seed(0)
    ros = grpo.collect_groups(env, pol, starts, 4, 3, generator=gen)
    r, s, g = grpo.rollout_returns(ros)
    batch = grpo.build_transitions(ros, torch.ones_like(r), torch.ones_like(r, dtype=torch.bool))
    lp = pol.log_prob(batch.obs, batch.samples)
    assert torch.allclose(lp, batch.samples.log_prob, atol=1e-4)
    _, st = grpo.clipped_surrogate_loss(lp, batch.samples.log_prob, batch.advantages)
    assert abs(st["ratio_mean"] - 1) < 1e-4 and st["clip_frac"] == 0
    before = [p.detach().clone() for p in pol.parameters()]
    opt = torch.optim.Adam([p for p in pol.parameters() if p.requires_grad], lr=1e-3)
    res = grpo.grpo_iteration(env, pol, opt, starts, cfg, generator=gen).stats
    for k in ("reward_mean", "success_rate", "valid_group_frac", "n_transitions"):
        assert math.isfinite(res[k])
    # the imagined returns differ inside the groups -> transitions enter the loss and the policy moves
    assert res["n_transitions"] > 0 and res["valid_group_frac"] > 0
    assert math.isfinite(res["approx_kl"]) and math.isfinite(res["grad_norm"])
    assert any(not torch.equal(a, b) for a, b in zip(before, pol.parameters()))
