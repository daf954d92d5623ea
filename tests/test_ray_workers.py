"""The Ray worker engine (wmrl.kernel.workers): a ChunkEnv split over Ray actors equals the one-process
env, GRPO in the sim gives the same update with 2 rollout workers as with 1, and a local cluster
listens on loopback only and writes nothing under the home directory."""

from __future__ import annotations

import ipaddress
import os

import numpy as np
import psutil
import pytest
import torch

from wmrl.kernel.types import Start


def _suite():
    from sim.suite import Suite

    return Suite(tasks=["lift_red", "push_red_to_target"], cameras=("agentview",), image_size=(16, 16))


def _starts(n):
    tasks = ["lift_red", "push_red_to_target"]
    return [Start(task_name=tasks[i % 2], instruction="", split="train", init_index=i // 2) for i in range(n)]


def _loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip.split("%")[0])
    return a.is_loopback or bool(getattr(a, "ipv4_mapped", None) and a.ipv4_mapped.is_loopback)


def test_a_chunk_env_on_two_actors_equals_the_one_process_env():
    from wmrl.kernel.workers import RayChunkEnv

    suite = _suite()
    one, two = suite.make_env(3), RayChunkEnv(suite.make_env, 3, workers=2)
    assert two.action_dim == one.action_dim and two.action_space == one.action_space
    a, b = one.reset(_starts(3)), two.reset(_starts(3))
    assert torch.equal(a.proprio, b.proprio) and torch.equal(a.images["agentview"], b.images["agentview"])
    assert a.task == b.task
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        act = torch.rand(3, 4, one.action_dim, generator=g) * 2 - 1
        ra, rb = one.step(act), two.step(act)
        for f in ("reward", "terminated", "truncated", "success", "steps_executed"):
            assert torch.equal(getattr(ra, f), getattr(rb, f)), f
        assert torch.equal(ra.obs.proprio, rb.obs.proprio)
        assert torch.equal(ra.info["final_obs"].images["agentview"], rb.info["final_obs"].images["agentview"])
        assert ra.info["task_name"] == rb.info["task_name"]
        assert torch.equal(ra.info["episode_length"], rb.info["episode_length"])
    for slot in (0, 1, 2):                # slots of both actors
        assert np.array_equal(one.sim_state(slot), two.sim_state(slot))
    a, b = one.reset_slots([2], _starts(1)), two.reset_slots([2], _starts(1))
    assert torch.equal(a.proprio, b.proprio)
    with pytest.raises(ValueError, match="out of range"):
        two.sim_state(3)
    with pytest.raises(ValueError, match="expects actions"):
        two.step(torch.zeros(4, 4, one.action_dim))
    with pytest.raises(ValueError, match="workers <= num_envs"):
        RayChunkEnv(suite.make_env, 1, workers=2)
    two.close()


def test_grpo_in_the_sim_gives_the_same_update_with_two_rollout_workers():
    from grpo_fakes import GaussianChunkPolicy

    from wmrl import rl as grpo
    from wmrl.run.builders import sim_chunk_env

    suite = _suite()
    params = {}
    for w in (1, 2):
        torch.manual_seed(0)
        pol = GaussianChunkPolicy(chunk_size=4, action_dim=7, obs_dim=9, init_std=0.5)
        opt = torch.optim.Adam(pol.parameters(), lr=0.05)
        env = sim_chunk_env(4, suite=suite, workers=w)
        cfg = grpo.GRPOConfig(group_size=2, max_chunks=3, epochs=1, minibatch_size=8, reward_mode="return+success")
        res = grpo.grpo_iteration(env, pol, opt, _starts(2), cfg, generator=torch.Generator().manual_seed(1))
        params[w] = ({k: v.detach().clone() for k, v in pol.state_dict().items()}, res.stats)
        if hasattr(env, "close"):
            env.close()                  # frees the actors' CPUs for the next test
    (p1, s1), (p2, s2) = params[1], params[2]
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    assert any(not torch.equal(p1[k], torch.zeros_like(p1[k])) for k in p1)  # the update did move the policy
    assert s1 == s2


def test_a_local_cluster_listens_on_loopback_only_and_leaves_home_alone():
    """Every listening socket of this process and its descendants (the Ray head: GCS, raylet, object
    store, agents, workers) is on a loopback address; HOME was pointed at an empty folder by conftest."""
    from wmrl.kernel.workers import ray_init

    ray = ray_init()

    @ray.remote(num_cpus=1)
    def pid():
        return os.getpid()

    ray.get([pid.remote() for _ in range(2)])
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    listening = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    assert len(procs) > 3 and listening, "no Ray process found listening"
    bad = [x for x in listening if not _loopback(x[1])]
    assert not bad, f"sockets listening beyond loopback: {bad}"
    home = os.path.expanduser("~")
    assert not os.path.exists(os.path.join(home, ".ray")), "Ray wrote under the home directory"


@pytest.mark.slow
def test_imagination_served_by_two_world_model_replicas_equals_one(tmp_path):
    """env.replicas=2: the learner's slots split over two Ray actors, each holding the world model and
    the critic; with a deterministic world model the rollouts equal one in-process ImaginationEnv."""
    from omegaconf import OmegaConf

    from wmrl.kernel.checkpoint import save_checkpoint
    from wmrl.kernel.types import Obs
    from wmrl.run.builders import imagination_chunk_env
    from worldmodels.critic import ProgressValueCritic
    from worldmodels.video_wm import ChunkFlowWorldModel

    torch.manual_seed(0)
    wm_cfg = {**OmegaConf.to_container(OmegaConf.load("configs/worldmodel/tiny.yaml")), "stochastic": False,
              "action_dim": 7, "action_low": -1.0, "action_high": 1.0}
    cr_cfg = OmegaConf.to_container(OmegaConf.load("configs/critic/tiny.yaml"))
    wm = ChunkFlowWorldModel(**{k: v for k, v in wm_cfg.items() if k != "_target_"})
    cr = ProgressValueCritic(**{k: v for k, v in cr_cfg.items() if k != "_target_"})
    wm.set_norm_stats(torch.rand(20, 9), torch.rand(20, 9) * 0.1)
    cr.set_norm_stats(torch.rand(20, 9))
    save_checkpoint(wm, tmp_path / "wm", wm_cfg)
    save_checkpoint(cr, tmp_path / "cr", cr_cfg)
    g = torch.Generator().manual_seed(0)

    def start(i):
        imgs = {c: torch.randint(0, 255, (1, 3, 32, 32), generator=g, dtype=torch.uint8)
                for c in ("agentview", "robot0_eye_in_hand")}
        return Start(task_name="lift_red", instruction="lift the red cube", split="train", init_index=i,
                     context=Obs(imgs, torch.rand(1, 9, generator=g), ["lift the red cube"]))

    starts = [start(i) for i in range(3)]
    opts = {"max_chunks": 3}
    one = imagination_chunk_env(str(tmp_path / "wm"), str(tmp_path / "cr"), 3, imagination=opts)
    two = imagination_chunk_env(str(tmp_path / "wm"), str(tmp_path / "cr"), 3, imagination=opts, replicas=2)
    a, b = one.reset(starts), two.reset(starts)
    assert torch.equal(a.proprio, b.proprio)
    for _ in range(2):
        act = torch.rand(3, 4, 7, generator=g) * 2 - 1
        ra, rb = one.step(act), two.step(act)
        assert torch.allclose(ra.obs.proprio, rb.obs.proprio, atol=1e-5)
        assert (ra.obs.images["agentview"].int() - rb.obs.images["agentview"].int()).abs().max() <= 1
        assert torch.allclose(ra.reward, rb.reward, atol=1e-5) and torch.equal(ra.terminated, rb.terminated)
    two.close()
    with pytest.raises(ValueError, match="workers <= num_envs"):
        imagination_chunk_env(str(tmp_path / "wm"), str(tmp_path / "cr"), 1, imagination=opts, replicas=2)
