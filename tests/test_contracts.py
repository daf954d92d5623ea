"""Contract tests: every implementation of a shared contract is checked here, parametrized over the
implementations (as LeRobot's policy tests are), so a new implementation joins by adding one entry.

Sections: EpisodeStore; ChunkEnv semantics of SimEnv; Policy (FlowVLAPolicy, LatentNoisePolicy,
LeRobotFlowPolicy, the GRPO test fake) and its declared capabilities; WorldModel (ChunkFlowWorldModel
and the example ConstantWorldModel) and ProgressCritic; ChunkEnv (SimEnv, ImaginationEnv over each
world model); Suite (every configs/suite/*.yaml and the example suite with a new task); Transport.
The examples in ``tests/examples/`` show that a world model and a task are each one class plus one
YAML file, with no edit to shared code.
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
def _simenv_lifted_start(suite, dz: float = 0.10):
    """A lift_red start whose cube is already ``dz`` m up: the task succeeds at the first inner step."""
    from sim.env import TaskEnv
    from wmrl.kernel.types import Start

    env = TaskEnv("two_cubes", cameras=())
    env.reset("lift_red", suite.init_state("lift_red", "eval", 0))
    jnt = env.rs.objects["red"].joints[0]
    q = env.sim.data.get_joint_qpos(jnt).copy()
    q[2] += dz
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


# ---------------------------------------------------------------------- shared fixtures of the role sections
import json
from pathlib import Path

import pytest

from wmrl.kernel import interfaces as I
from wmrl.kernel.types import PolicySample, Start

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = Path(__file__).resolve().parent / "examples" / "configs"


def compose(config_name: str, overrides: list[str]):
    """The project's Hydra config ``config_name`` with ``tests/examples/configs`` on the search path
    (how a user adds a config group entry without editing ``configs/``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return hydra_compose(config_name, overrides=[*overrides, f"hydra.searchpath=[file://{EXAMPLES}]"])


def synthetic_obs(b: int = 3, size: int = 32) -> Obs:
    """First frames of ``b`` episodes of the 2-D toy (``worldmodels.synthetic``): both cameras, ``D_s = 9``."""
    from worldmodels.synthetic import make_episode

    eps = [make_episode(seed=i, length=2, size=size) for i in range(b)]
    return Obs({c: torch.from_numpy(np.stack([e.images[c][0] for e in eps])) for c in (AGENTVIEW, EYE_IN_HAND)},
               torch.from_numpy(np.stack([e.proprio[0] for e in eps])).float(),
               [e.instruction for e in eps]).validate()


def _norm_stats():
    from wmrl.kernel.storage import NormStats

    rng = np.random.default_rng(0)
    return NormStats.from_data({"proprio": rng.standard_normal((64, 9)), "actions": rng.uniform(-1, 1, (64, 7))})


# ---------------------------------------------------------------------- Policy: every implementation
# FlowVLAPolicy, LatentNoisePolicy (steering a FlowVLAPolicy), LeRobotFlowPolicy (tiny SmolVLA) and the
# GRPO test fake. ``flow`` / ``steerable``: the capability protocols each one declares.
POLICIES = {"flow_vla": (True, True), "latent_noise": (False, False), "lerobot_smolvla": (False, False),
            "fake": (False, False)}


def _flow_vla(sampler):
    from policies.flow_vla import FlowVLAPolicy

    torch.manual_seed(0)
    return FlowVLAPolicy(cameras=[AGENTVIEW], image_size=[16, 16], chunk_size=4,
                         encoder={"kind": "conv", "channels": [8, 16], "out_dim": 16}, lang_dim=16, proprio_dim=8,
                         cond_dim=32, head_width=32, head_depth=1, time_dim=16,
                         sampler=sampler).set_norm_stats(_norm_stats()).eval()


@pytest.fixture(scope="module", params=list(POLICIES))
def policy_case(request, tmp_path_factory):
    """``(name, policy in eval mode with a stochastic sampler, obs of batch 3)``."""
    from policies.samplers import EulerODESampler, SDESampler

    g = torch.Generator().manual_seed(0)
    img = {AGENTVIEW: torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8, generator=g)}
    obs = Obs(img, torch.randn(3, 9, generator=g), ["lift the red cube"] * 3).validate()
    name = request.param
    if name == "flow_vla":
        pol = _flow_vla(SDESampler(num_steps=3, noise_level=0.5))
    elif name == "latent_noise":
        from policies.steering import LatentNoisePolicy, LatentNoiseSampler

        pol = LatentNoisePolicy(_flow_vla(EulerODESampler(3, noise_scale=0.0)), hidden=16,
                                sampler=LatentNoiseSampler(0.5, 3)).eval()
    elif name == "lerobot_smolvla":
        from policies.lerobot_tiny import tiny_smolvla

        torch.manual_seed(0)
        pol = tiny_smolvla(tmp_path_factory.mktemp("smolvlm"), cameras=(AGENTVIEW,), image_size=(16, 16),
                           chunk_size=4, num_steps=2, sampler=SDESampler(2, 0.5)).set_norm_stats(_norm_stats()).eval()
    else:
        from grpo_fakes import GaussianChunkPolicy

        pol = GaussianChunkPolicy(chunk_size=4, action_dim=3, obs_dim=9)
    return name, pol, obs


def test_policy_contract_sample_and_log_prob(policy_case):
    name, pol, obs = policy_case
    assert isinstance(pol, I.Policy), name
    assert isinstance(pol.chunk_size, int) and isinstance(pol.action_dim, int) and isinstance(pol.supports_rtc, bool)
    h, d = pol.chunk_size, pol.action_dim
    s = pol.sample(obs, torch.Generator().manual_seed(1))
    assert isinstance(s, PolicySample)
    assert s.actions.shape == (3, h, d) and s.actions.dtype == torch.float32 and torch.isfinite(s.actions).all()
    assert s.log_prob.shape == (3,) and s.log_prob.dtype == torch.float32
    assert all(v.shape[0] == 3 for v in s.extras.values())  # extras are batch-indexable
    again = pol.sample(obs, torch.Generator().manual_seed(1))
    assert torch.equal(again.actions, s.actions)  # seeded
    lp = pol.log_prob(obs, s)
    assert lp.shape == (3,) and lp.dtype == torch.float32 and lp.requires_grad
    assert torch.allclose(lp, s.log_prob, atol=1e-4, rtol=0)  # ratio 1 at unchanged parameters
    per = pol.log_prob(obs, s, per_step=True)
    assert per.ndim == 2 and per.shape[0] == 3 and per.shape[1] >= 1 and per.dtype == torch.float32
    # GRPO recomputes on minibatches: the log-prob of a subset matches
    sub = pol.log_prob(obs.index([0, 2]), s.index(torch.tensor([0, 2])))
    assert torch.allclose(sub, s.log_prob[[0, 2]], atol=1e-3)


def test_policy_declares_its_capabilities(policy_case):
    name, pol, obs = policy_case
    flow, steerable = POLICIES[name]
    assert isinstance(pol, I.FlowPolicy) == flow and isinstance(pol, I.SteerableFlowPolicy) == steerable, name
    assert isinstance(pol, I.SamplerPolicy) == (name != "fake"), name
    if flow:
        s = pol.sample(obs, torch.Generator().manual_seed(2))
        g = torch.Generator().manual_seed(3)
        t, eps = torch.rand(3, 2, generator=g), torch.randn(3, 2, pol.chunk_size, pol.action_dim, generator=g)
        loss = pol.flow_matching_loss(obs, s, t, eps)
        assert loss.shape == (3,) and loss.dtype == torch.float32 and loss.requires_grad and (loss >= 0).all()
    if steerable:
        cond = pol.encode(obs.images, obs.proprio, obs.task)
        assert cond.shape == (3, int(pol.init_config["cond_dim"]))
        v = pol.velocity(torch.zeros(3, pol.chunk_size, pol.action_dim), torch.ones(3), cond)
        assert v.shape == (3, pol.chunk_size, pol.action_dim)


# ---------------------------------------------------------------------- WorldModel / ProgressCritic: every implementation
# ChunkFlowWorldModel (configs/worldmodel/tiny.yaml) and the example ConstantWorldModel, added by one class
# and one YAML file (tests/examples/), built through the project's Hydra config like any world model.


def _world_model(name: str):
    from hydra.utils import instantiate

    if name in ("chunk_flow", "chunk_flow_dynamics"):
        cfg = compose("train_worldmodel", ["worldmodel=tiny"]).worldmodel
        if name == "chunk_flow_dynamics":   # the proprio dynamics ensemble in the ee action space
            from wmrl.kernel.types import PANDA_EE_YAW

            cfg.action_dim = 5
            cfg.dynamics = {"action_space": PANDA_EE_YAW.to_dict(), "ensemble": 2, "hidden": 16}
        wm = instantiate(cfg, _convert_="all").eval()
        wm.set_norm_stats(torch.randn(16, 9, generator=torch.Generator().manual_seed(0)),
                          torch.randn(16, 9, generator=torch.Generator().manual_seed(1)))
        return wm
    return instantiate(compose("train_worldmodel", ["worldmodel=constant"]).worldmodel, _convert_="all")


def _critic():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cr = instantiate(OmegaConf.load(ROOT / "configs/critic/tiny.yaml"), _convert_="all").eval()
    cr.set_norm_stats(torch.randn(16, 9, generator=torch.Generator().manual_seed(2)))
    return cr


@pytest.mark.parametrize("name", ["chunk_flow", "chunk_flow_dynamics", "constant"])
def test_world_model_contract(name):
    wm = _world_model(name)
    assert isinstance(wm, I.WorldModel), name
    assert isinstance(wm.action_dim, int) and isinstance(wm.chunk_size, int) and wm.context_frames >= 1
    obs = synthetic_obs(3)
    state = wm.init(obs)
    acts = torch.rand(3, wm.chunk_size, wm.action_dim, generator=torch.Generator().manual_seed(0)) * 2 - 1
    state2, pred = wm.imagine(state, acts, generator=torch.Generator().manual_seed(1))
    pred.validate()
    assert set(pred.images) == set(obs.images) and pred.task == obs.task
    assert all(v.dtype == torch.uint8 and v.shape == obs.images[c].shape for c, v in pred.images.items())
    assert pred.proprio.dtype == torch.float32 and pred.proprio.shape == (3, 9)
    # explicit state: the old state is still usable and the same seed gives the same prediction
    _, again = wm.imagine(state, acts, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(again.images[c], pred.images[c]) for c in pred.images)
    wm.imagine(state2, acts, generator=torch.Generator().manual_seed(2))[1].validate()
    with pytest.raises(ValueError):
        wm.imagine(state, torch.zeros(3, wm.chunk_size + 1, wm.action_dim))


def test_progress_critic_contract():
    cr = _critic()
    assert isinstance(cr, I.ProgressCritic)
    obs = synthetic_obs(3)
    p, s = cr.progress(obs), cr.success_prob(obs)
    assert p.shape == s.shape == (3,) and p.dtype == s.dtype == torch.float32
    assert ((p >= 0) & (p <= 1)).all() and ((s >= 0) & (s <= 1)).all()
    ep, es = cr.evaluate(obs)
    assert torch.allclose(ep, p, atol=1e-6) and torch.allclose(es, s, atol=1e-6)


# ---------------------------------------------------------------------- ChunkEnv: every implementation
# SimEnv (the tiny suite at 16 x 16, one camera), ImaginationEnv over each world model and the GRPO test fake.
CHUNK_ENVS = ["sim", "imagination_chunk_flow", "imagination_constant", "fake"]


def _chunk_env(name: str):
    """``(env with B = 2, three starts, the chunk length H it takes)``."""
    if name == "sim":
        from sim.suite import Suite

        suite = Suite(tasks=["lift_red"], cameras=[AGENTVIEW], image_size=(16, 16))
        return suite.make_env(2, auto_reset=True), [suite.eval_start("lift_red", j) for j in range(3)], 4
    if name == "fake":
        from grpo_fakes import ToyReachEnv, toy_starts

        return ToyReachEnv(2), toy_starts(2)[1:], 4
    from wmrl.imagination import ImaginationEnv

    obs = synthetic_obs(3)
    starts = [Start("lift_red", obs.task[i], context=obs.index([i])) for i in range(3)]
    wm = _world_model(name.split("_", 1)[1])
    return ImaginationEnv(wm, _critic(), num_envs=2, max_chunks=3, success_threshold=2.0), starts, wm.chunk_size


@pytest.mark.parametrize("name", CHUNK_ENVS)
def test_chunk_env_contract_step_and_reset_slots(name):
    env, starts, h = _chunk_env(name)
    assert isinstance(env, I.ChunkEnv), name
    assert isinstance(env, I.SimStateEnv) == (name == "sim"), name
    b, d = env.num_envs, env.action_dim
    with pytest.raises(ValueError):
        env.reset(starts[:1])
    obs0 = env.reset(starts[:2]).validate()
    assert obs0.batch_size == b
    res = env.step(torch.zeros(b, h, d))
    res.obs.validate()
    assert res.reward.dtype == torch.float32 and res.reward.shape == (b,)
    assert all(x.dtype == torch.bool and x.shape == (b,) for x in (res.terminated, res.truncated, res.success))
    assert res.steps_executed.dtype == torch.int64 and ((res.steps_executed >= 1) & (res.steps_executed <= h)).all()
    assert torch.equal(res.done, res.terminated | res.truncated) and res.info["final_obs"].batch_size == b
    # reset_slots resets only the given slots (to the same frames a full reset gives) and returns the whole batch
    fresh = env.reset_slots([1], [starts[2]]).validate()
    ref = _chunk_env(name)[0]
    want = ref.reset([starts[0], starts[2]])
    assert fresh.batch_size == b and fresh.task[1] == want.task[1]
    for c in fresh.images:
        assert torch.equal(fresh.images[c][1], want.images[c][1])
        assert torch.equal(fresh.images[c][0], res.obs.images[c][0])
    assert env.step(torch.zeros(b, h, d)).steps_executed.shape == (b,)
    with pytest.raises(ValueError):
        env.reset_slots([0, 1], starts[:1])
    with pytest.raises(ValueError):
        env.reset_slots([b], starts[:1])
    with pytest.raises(ValueError):
        env.step(torch.zeros(b, d))


def test_imagination_env_truncates_at_max_chunks_and_auto_resets_to_the_start_frame():
    env, starts, h = _chunk_env("imagination_chunk_flow")
    obs0 = env.reset(starts[:2])
    r = [env.step(torch.zeros(2, h, 7)) for _ in range(3)]
    assert not r[0].done.any() and not r[1].done.any() and r[0].steps_executed.tolist() == [h, h]
    assert r[2].truncated.all() and not r[2].terminated.any() and "final_obs" in r[2].info
    assert torch.equal(r[2].obs.images[AGENTVIEW], obs0.images[AGENTVIEW])


# ---------------------------------------------------------------------- Suite: every suite config
# configs/suite/*.yaml and the example suite that adds a task by one class and one YAML file (tests/examples/).
SUITES = ["default", "tiny", "visual", "lift_high"]


def _suite(name: str):
    from hydra.utils import instantiate

    return instantiate(compose("evaluate", [f"suite={name}"]).suite)


@pytest.mark.parametrize("name", SUITES)
def test_suite_contract(name):
    suite = _suite(name)
    assert isinstance(suite, I.Suite), name
    assert suite.task_names and len(set(suite.task_names)) == len(suite.task_names)
    assert suite.action_space.dim == len(suite.action_space.low) and suite.action_space.dim in (5, 7)
    assert suite.state_dim == 9 and suite.fps > 0 and len(suite.image_size) == 2
    for t in suite.task_names:
        assert isinstance(suite.instruction(t), str) and suite.instruction(t)
        assert suite.max_steps(t) > 0
        n_eval, n_train = suite.num_init_states(t, "eval"), suite.num_init_states(t, "train")
        assert n_eval > 0 and n_train > 0
        s = suite.eval_start(t, n_eval + 1)
        assert (s.task_name, s.split, s.init_index, s.instruction) == (t, "eval", 1, suite.instruction(t))
        assert suite.train_start(t, 3).init_index == 3 % n_train and suite.train_start(t, 3).split == "train"
        assert suite.init_state(t, "eval", 0).ndim == 1
    with pytest.raises(ValueError):
        suite.instruction("no_such_task")
    json.dumps(suite.describe())
    env = suite.make_env(1, auto_reset=False, cameras=())
    assert isinstance(env, I.ChunkEnv) and env.num_envs == 1 and env.action_dim == suite.action_space.dim


def _hold_action(suite, env) -> torch.Tensor:
    """One step ``(B, 1, D_a)`` that keeps every arm where it is: the zero delta, or in the absolute
    target space the current end-effector pose (gripper command 0 in both)."""
    from sim.control import yaw_of_down_mat

    if suite.action_space.mode != "absolute":
        return torch.zeros(env.num_envs, 1, suite.action_space.dim)
    rows = []
    for slot in range(env.num_envs):
        pos, mat = env.task_env(slot).eef_pose()
        rows.append([*pos, yaw_of_down_mat(mat), 0.0])
    return torch.tensor(rows, dtype=torch.float32)[:, None]


def test_new_task_is_a_class_and_a_yaml_entry():
    """``tests/examples/lift_high_task.py`` + ``configs/suite/lift_high.yaml``: the suite's env and its
    scripted expert run the new task by name, with its own success predicate."""
    suite = _suite("lift_high")
    assert suite.task_names == ["lift_red", "lift_red_high"]
    assert type(suite.task("lift_red_high")).__name__ == "LiftHighTask"
    env = suite.make_env(2, auto_reset=False, cameras=())
    for dz, high in ((0.07, False), (0.12, True)):
        low_start = _simenv_lifted_start(suite, dz)
        high_start = Start("lift_red_high", suite.instruction("lift_red_high"), sim_state=low_start.sim_state)
        env.reset([low_start, high_start])
        res = env.step(_hold_action(suite, env))
        assert res.success.tolist() == [True, high], dz
    expert = suite.make_expert()
    env.reset([suite.eval_start("lift_red_high", 0), suite.eval_start("lift_red", 0)])
    expert.begin(0, "lift_red_high", seed=0)
    expert.begin(1, "lift_red", seed=0)
    a = expert.act(env, None, [True, True])
    assert a.shape == (2, 1, suite.action_space.dim) and torch.equal(a[0], a[1])  # same scene, same init state: the same lift expert


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
