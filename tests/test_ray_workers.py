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
    one, two = suite.make_env(5), RayChunkEnv(suite.make_env, 5, workers=2)
    assert two.action_dim == one.action_dim and two.action_space == one.action_space
    a, b = one.reset(_starts(5)), two.reset(_starts(5))
    assert torch.equal(a.proprio, b.proprio) and torch.equal(a.images["agentview"], b.images["agentview"])
    assert a.task == b.task
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        act = torch.rand(5, 4, one.action_dim, generator=g) * 2 - 1
        ra, rb = one.step(act), two.step(act)
        for f in ("reward", "terminated", "truncated", "success", "steps_executed"):
            assert torch.equal(getattr(ra, f), getattr(rb, f)), f
        assert torch.equal(ra.obs.proprio, rb.obs.proprio)
        assert torch.equal(ra.info["final_obs"].images["agentview"], rb.info["final_obs"].images["agentview"])
        assert ra.info["task_name"] == rb.info["task_name"]
        assert torch.equal(ra.info["episode_length"], rb.info["episode_length"])
    for slot in (0, 2, 3, 4):             # slots of both actors
        assert np.array_equal(one.sim_state(slot), two.sim_state(slot))
    a, b = one.reset_slots([3], _starts(1)), two.reset_slots([3], _starts(1))
    assert torch.equal(a.proprio, b.proprio)
    with pytest.raises(ValueError, match="out of range"):
        two.sim_state(5)
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
