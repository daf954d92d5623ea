"""Contract tests: every implementation of a shared contract is checked here.

Sections: EpisodeStore (below). Other packages add their protocol implementations
(WorldModel, ProgressCritic, Policy, ChunkEnv, Transport) in their own sections.
"""

from __future__ import annotations

import numpy as np
import torch

# ---------------------------------------------------------------------- EpisodeStore / WindowDataset
from wmrl.kernel.storage import EpisodeStore, NormStats, WindowDataset
from wmrl.kernel.storage.synthetic import random_episode, random_store
from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND, Episode, Obs


def test_store_contract_episode_container_and_meta(tmp_path):
    cams = {AGENTVIEW: (8, 8), EYE_IN_HAND: (8, 8)}
    s = random_store(tmp_path / "s", lengths=[4, 3], cameras=cams)
    ep = EpisodeStore.open(s.path).episode(0)
    assert isinstance(ep, Episode) and ep.length == 4
    assert ep.images[AGENTVIEW].dtype == np.uint8 and ep.images[AGENTVIEW].shape == (4, 3, 8, 8)
    assert ep.proprio.dtype == np.float32 and ep.proprio.shape == (4, 9)
    assert ep.actions.dtype == np.float32 and ep.actions.shape == (4, 7)
    assert ep.rewards.dtype == np.float32 and ep.rewards.shape == (4,)
    assert set(s.meta) >= {"cameras", "state_dim", "action_dim", "fps", "action_space", "embodiment", "source",
                           "format_version"}
    assert s.lengths.dtype == np.int64 and isinstance(s.stats(), NormStats)


def test_window_batch_converts_to_obs(tmp_path):
    """A WindowDataset batch's last observation is a valid ``Obs`` for a policy / world model."""
    cams = {AGENTVIEW: (8, 8)}
    s = random_store(tmp_path / "s", lengths=[5], cameras=cams)
    b = WindowDataset(s, n_obs=2, horizon=3).get_batch([0, 4])
    obs = Obs(images={c: v[:, -1] for c, v in b["images"].items()}, proprio=b["proprio"][:, -1],
              task=b["instruction"]).validate()
    assert obs.batch_size == 2 and b["actions"].dtype == torch.float32
    assert b["obs_pad"].dtype == torch.bool and b["action_pad"].dtype == torch.bool
    np.testing.assert_array_equal(obs.images[AGENTVIEW][1].numpy(), random_episode(5, cams, seed=0).images[AGENTVIEW][4])


# ---------------------------------------------------------------------- ChunkEnv: sim.env.SimEnv
# (section owned by the sim package)
def _simenv_lifted_start(suite):
    """A lift_red start whose cube is already 10 cm up: the task succeeds at the first inner step."""
    from sim.env import TaskEnv
    from wmrl.kernel.types import Start

    env = TaskEnv("two_cubes", cameras=())
    env.reset("lift_red", suite.init_state("lift_red", "eval", 0))
    jnt = env.rs.objects["red"].joints[0]
    q = env.sim.data.get_joint_qpos(jnt).copy()
    q[2] += 0.10
    env.sim.data.set_joint_qpos(jnt, q)
    env.sim.forward()
    return Start("lift_red", "lift the red cube", sim_state=env.sim_state())


def test_simenv_is_a_chunk_env_with_inner_step_termination_and_partial_auto_reset():
    import pytest

    from sim.suite import Suite
    from wmrl.kernel.interfaces import ChunkEnv

    suite = Suite(tasks=["lift_red"], image_size=(32, 32))
    env = suite.make_env(2, auto_reset=True)
    assert isinstance(env, ChunkEnv) and env.num_envs == 2 and env.action_dim == 7
    obs0 = env.reset([_simenv_lifted_start(suite), suite.eval_start("lift_red", 1)]).validate()
    res = env.step(torch.zeros(2, 4, 7))
    res.obs.validate()
    assert res.steps_executed.dtype == torch.int64 and res.steps_executed.tolist() == [1, 4]
    assert res.reward.dtype == torch.float32 and res.reward.tolist() == [1.0, 0.0]
    assert res.terminated.tolist() == [True, False] and res.truncated.tolist() == [False, False]
    assert res.success.tolist() == [True, False] and res.done.tolist() == [True, False]
    assert torch.equal(res.obs.images[AGENTVIEW][0], obs0.images[AGENTVIEW][0])  # slot 0 reset, slot 1 not
    assert "final_obs" in res.info and res.info["final_obs"].batch_size == 2
    with pytest.raises(ValueError):
        env.step(torch.zeros(2, 7))


# ---------------------------------------------------------------------- Policy: policies.flow_vla.FlowVLAPolicy
# (section owned by the policies package; the LeRobot adapters are checked in test_lerobot_adapters.py)


def test_flow_vla_policy_contract():
    from policies.flow_vla import FlowVLAPolicy
    from policies.samplers import SDESampler
    from wmrl.kernel.interfaces import Policy
    from wmrl.kernel.storage import NormStats
    from wmrl.kernel.types import Obs

    rng = np.random.default_rng(0)
    pol = FlowVLAPolicy(cameras=["agentview"], image_size=[16, 16], chunk_size=4,
                        encoder={"kind": "conv", "channels": [8, 16], "out_dim": 16}, lang_dim=16, proprio_dim=8,
                        cond_dim=32, head_width=32, head_depth=1, time_dim=16,
                        sampler=SDESampler(num_steps=3, noise_level=0.5))
    pol.set_norm_stats(NormStats.from_data({"proprio": rng.standard_normal((64, 9)),
                                            "actions": rng.uniform(-1, 1, (64, 7))})).eval()
    assert isinstance(pol, Policy) and pol.chunk_size == 4 and pol.action_dim == 7
    g = torch.Generator().manual_seed(0)
    obs = Obs({"agentview": torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8, generator=g)},
              torch.randn(3, 9, generator=g), ["lift the red cube"] * 3).validate()
    s = pol.sample(obs, torch.Generator().manual_seed(1))
    assert s.actions.shape == (3, 4, 7) and s.actions.dtype == torch.float32
    assert s.log_prob.shape == (3,) and s.log_prob.dtype == torch.float32
    assert all(v.shape[0] == 3 for v in s.extras.values())  # extras batch-indexable
    lp = pol.log_prob(obs, s)
    assert lp.requires_grad and torch.equal(torch.exp(lp - s.log_prob), torch.ones(3))
    # GRPO recomputes on minibatches: the log-prob of a subset matches (up to float rounding)
    sub = pol.log_prob(obs.index([0, 2]), s.index(torch.tensor([0, 2])))
    assert torch.allclose(sub, s.log_prob[[0, 2]], atol=1e-3)


# ---------------------------------------------------------------------- WorldModel / ProgressCritic / ChunkEnv:
# worldmodels.video_wm.ChunkFlowWorldModel, worldmodels.critic.ProgressValueCritic, wmrl.imagination.ImaginationEnv
# (section owned by the worldmodels package)


def test_worldmodel_critic_and_imagination_env_contracts():
    import pytest
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from wmrl.imagination import ImaginationEnv
    from wmrl.kernel.interfaces import ChunkEnv, ProgressCritic, WorldModel
    from wmrl.kernel.types import Start

    wm = instantiate(OmegaConf.load("configs/worldmodel/tiny.yaml"), _convert_="all").eval()
    wm.set_norm_stats(torch.randn(16, 9), torch.randn(16, 9))
    cr = instantiate(OmegaConf.load("configs/critic/tiny.yaml"), _convert_="all").eval()
    cr.set_norm_stats(torch.randn(16, 9))
    assert isinstance(wm, WorldModel) and isinstance(cr, ProgressCritic)
    g = torch.Generator().manual_seed(0)
    obs = Obs({c: torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=g) for c in (AGENTVIEW, EYE_IN_HAND)},
              torch.randn(3, 9, generator=g), ["lift the red cube"] * 3).validate()
    state = wm.init(obs)
    state2, pred = wm.imagine(state, torch.zeros(3, wm.chunk_size, 7), generator=torch.Generator().manual_seed(1))
    pred.validate()
    assert pred.images[AGENTVIEW].shape == (3, 3, 32, 32) and pred.proprio.dtype == torch.float32
    wm.imagine(state, torch.zeros(3, wm.chunk_size, 7))          # the old state is still usable (explicit state)
    p, s = cr.progress(pred), cr.success_prob(pred)
    assert p.shape == s.shape == (3,) and ((p >= 0) & (p <= 1)).all() and ((s >= 0) & (s <= 1)).all()
    env = ImaginationEnv(wm, cr, num_envs=3, max_chunks=2, success_threshold=2.0)
    assert isinstance(env, ChunkEnv) and env.num_envs == 3 and env.action_dim == 7
    starts = [Start("lift_red", "lift the red cube", context=obs.index([i])) for i in range(3)]
    env.reset(starts).validate()
    r1 = env.step(torch.zeros(3, wm.chunk_size, 7))
    r1.obs.validate()
    assert r1.reward.dtype == torch.float32 and r1.steps_executed.dtype == torch.int64
    assert r1.steps_executed.tolist() == [wm.chunk_size] * 3 and not r1.done.any()
    r2 = env.step(torch.zeros(3, wm.chunk_size, 7))
    assert r2.truncated.all() and not r2.terminated.any() and "final_obs" in r2.info
    # auto-reset brought every slot back to its start frame
    assert torch.equal(r2.obs.images[AGENTVIEW], obs.images[AGENTVIEW])
    with pytest.raises(ValueError):
        env.step(torch.zeros(3, 7))


# ---------------------------------------------------------------------- Transport: robot_bridge.transports
# in-process, gRPC (127.0.0.1) and ROS 2 (Cyclone DDS, loopback-only config): same protocol, same behaviour.


def _transport_pairs():
    import os

    from robot_bridge.messages import Envelope, Limits
    from robot_bridge.transports.grpc_transport import GrpcClientTransport, GrpcServer
    from robot_bridge.transports.inproc import InProcTransport
    from robot_bridge.transports.ros2 import Ros2Transport

    robot_lim, server_lim = Limits(action_dim=7), Limits(state_dim=9)
    yield "inproc", InProcTransport.pair(robot_lim, server_lim), None
    gs = GrpcServer("127.0.0.1:0", server_lim)
    robot = GrpcClientTransport(gs.address, robot_lim, connect_timeout_s=5)
    robot.send_bytes(b"\x2a\x00")  # a heartbeat envelope opens the stream
    server = gs.accept(timeout=5)
    server.recv(timeout=5)
    yield "grpc", (robot, server), gs
    dom = 150 + os.getpid() % 50
    srv = Ros2Transport("server", cameras=["agentview"], domain_id=dom, limits=server_lim)
    rob = Ros2Transport("robot", cameras=["agentview"], domain_id=dom, limits=robot_lim)
    assert rob.wait_for_peer(5) and srv.wait_for_peer(5)
    rob.send(Envelope(heartbeat={}))  # opens the robot's session (one per DDS participant)
    session = srv.accept(timeout=5)
    session.recv(timeout=5)
    yield "ros2", (rob, session), srv


def test_transport_contract():
    import time

    import numpy as np

    from robot_bridge import messages as M
    from wmrl.kernel.interfaces import Transport

    def recv_kind(t, kind):
        t_end = time.monotonic() + 5
        while time.monotonic() < t_end:
            env = t.recv(timeout=0.1)
            if env is not None and M.kind(env) == kind:
                return env
        raise AssertionError(f"no {kind}")

    for name, (robot, server), extra in _transport_pairs():
        assert isinstance(robot, Transport) and isinstance(server, Transport), name
        assert robot.recv(timeout=0.05) is None, name  # nothing pending: None after the timeout
        obs = M.make_observation(episode=1, step=4, proprio=np.arange(9), images={"agentview": np.zeros((8, 8, 3))},
                                 task="lift", request=True, request_id=3)
        robot.send(obs)
        got = recv_kind(server, "observation").observation
        assert (got.step, got.request_id, len(got.proprio)) == (4, 3, 9), name
        server.send(M.make_chunk(actions=np.ones((16, 7)), start_step=4, obs_stamp_ns=got.stamp_ns, request_id=3))
        ch = recv_kind(robot, "chunk").chunk
        assert M.chunk_array(ch).shape == (16, 7) and ch.start_step == 4, name
        server.send(M.make_chunk(actions=np.ones((16, 5)), start_step=4))  # wrong D_a for this robot
        t_end = time.monotonic() + 5
        with __import__("pytest").raises(M.MessageError):
            while time.monotonic() < t_end:
                robot.recv(timeout=0.1)
        robot.close()
        server.close()
        if extra is not None:
            extra.stop(0) if hasattr(extra, "stop") else extra.close()
