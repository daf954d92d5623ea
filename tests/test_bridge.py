"""Robot bridge: messages, queue merge, safety, real-time chunking, server/client faults (in-process)."""

import threading
import time

import numpy as np
import pytest
import torch

from robot_bridge import messages as M
from robot_bridge.client import ClientConfig, RobotClient
from robot_bridge.queue import ActionQueue
from robot_bridge.safety import SafetyFilter, SafetyLimits, Watchdog
from robot_bridge.server import PolicyServer, obs_from_message
from robot_bridge.testing import GoalPolicy, KinematicArm, TrackingPolicy
from robot_bridge.transports.inproc import InProcTransport
from policies.rtc import rtc_sample
from wmrl.kernel.types import Obs, PolicySample

D_A, D_S = 7, 9


def _obs_env(step=3, request=True, **kw):
    return M.make_observation(episode=0, step=step, proprio=np.arange(D_S, dtype=np.float32),
                              images={"agentview": np.full((8, 8, 3), 7, np.uint8)}, task="lift",
                              request=request, **kw)


# ----------------------------------------------------------------------------- messages

def test_observation_roundtrip_and_chw_images():
    img = np.random.default_rng(0).integers(0, 255, (3, 8, 6), dtype=np.uint8)
    env = M.make_observation(episode=2, step=5, proprio=np.ones(D_S), images={"agentview": img}, task="t",
                             request=True, prefix_actions=np.ones((4, D_A)))
    back = M.decode(M.encode(env), M.Limits(state_dim=D_S, action_dim=D_A))
    proprio, images, prefix = M.observation_arrays(back.observation)
    assert back.observation.step == 5 and back.observation.task == "t"
    np.testing.assert_array_equal(images["agentview"], img)
    assert proprio.shape == (D_S,) and prefix.shape == (4, D_A)


def test_malformed_oversized_and_empty_are_rejected():
    with pytest.raises(M.MessageError) as e:
        M.decode(b"\xff\xff\xff\xff garbage")
    assert e.value.code == "malformed"
    with pytest.raises(M.MessageError) as e:
        M.decode(b"")
    assert e.value.code == "malformed"
    big = M.encode(_obs_env())
    with pytest.raises(M.MessageError) as e:
        M.decode(big, M.Limits(max_message_bytes=len(big) - 1))
    assert e.value.code == "oversized"
    with pytest.raises(M.MessageError):
        M.encode(_obs_env(), M.Limits(max_message_bytes=10))


def test_chunk_of_wrong_dimension_and_bad_values_rejected():
    lim = M.Limits(action_dim=D_A)
    ok = M.make_chunk(actions=np.zeros((16, D_A)), start_step=0)
    assert M.decode(M.encode(ok), lim).chunk.horizon == 16
    wrong = M.make_chunk(actions=np.zeros((16, 6)), start_step=0)
    with pytest.raises(M.MessageError, match="action_dim=6"):
        M.decode(M.encode(wrong), lim)
    bad = M.make_chunk(actions=np.zeros((16, D_A)), start_step=0)
    del bad.chunk.actions[-1]
    with pytest.raises(M.MessageError, match="H\\*D_a"):
        M.decode(M.encode(bad), lim)
    nan = M.make_chunk(actions=np.full((2, D_A), np.nan), start_step=0)
    with pytest.raises(M.MessageError, match="NaN"):
        M.decode(M.encode(nan), lim)


@pytest.mark.parametrize("case", ["nan", "inf", "huge", "over_long", "not_rows", "delay_past_chunk", "no_len"])
def test_rtc_prefix_is_validated_like_every_numeric_field(case):
    lim = M.Limits(action_dim=D_A, chunk_size=16)
    prefix = {"nan": np.full((4, D_A), np.nan), "inf": np.full((4, D_A), -np.inf), "huge": np.full((4, D_A), 1e30),
              "over_long": np.zeros((17, D_A))}.get(case, np.zeros((4, D_A)))
    env = _obs_env(prefix_actions=prefix.astype(np.float32), request_id=5)
    if case == "not_rows":
        env.observation.prefix_actions.append(0.0)
    elif case == "delay_past_chunk":
        env.observation.delay_steps = 17
    elif case == "no_len":
        env.observation.prefix_len = 0
    why = {"nan": "RTC prefix .* NaN or inf", "inf": "RTC prefix .* NaN or inf", "huge": "magnitude 1e\\+30",
           "over_long": "prefix_len=17 actions is longer than the chunk length H=16",
           "not_rows": "expected prefix_len\\*D_a=4\\*7", "delay_past_chunk": "delay_steps=17 exceeds the chunk length H=16",
           "no_len": "28 values but prefix_len=0"}[case]
    with pytest.raises(M.MessageError, match=why) as e:
        M.decode(M.encode(env), lim)
    assert e.value.code == "invalid" and e.value.request_id == 5 and str(e.value).startswith("[invalid] ")
    ok = _obs_env(prefix_actions=np.full((16, D_A), 0.5, np.float32))
    ok.observation.delay_steps = 16
    M.decode(M.encode(ok), lim)  # a full-length prefix, every action frozen, is fine
    ahead = _obs_env(prefix_actions=np.zeros((4, D_A), np.float32))
    ahead.observation.delay_steps = 10  # past the robot's prefix: the server's record of chunks in flight
    M.decode(M.encode(ahead), lim)
    over = _obs_env(prefix_actions=np.zeros((300, D_A), np.float32))
    with pytest.raises(M.MessageError, match="longer than max_horizon=256"):
        M.decode(M.encode(over), M.Limits())  # H unknown: the generic bound, named as such


def test_other_numeric_fields_are_validated():
    lim = M.Limits(action_dim=D_A)
    big = _obs_env()
    big.observation.proprio[0] = 1e30
    with pytest.raises(M.MessageError, match="proprio has a value of magnitude"):
        M.decode(M.encode(big), lim)
    neg = _obs_env(step=-1)
    with pytest.raises(M.MessageError, match="step=-1"):
        M.decode(M.encode(neg), lim)
    ch = M.make_chunk(actions=np.zeros((16, D_A)), start_step=0, inference_s=float("nan"))
    with pytest.raises(M.MessageError, match="inference_s"):
        M.decode(M.encode(ch), lim)
    ch = M.make_chunk(actions=np.full((16, D_A), 1e30), start_step=0)
    with pytest.raises(M.MessageError, match="action chunk has a value of magnitude"):
        M.decode(M.encode(ch), lim)
    hello = M.Envelope(hello=M.pb.Hello(action_dim=D_A, state_dim=D_S, image_height=65535, image_width=65535))
    with pytest.raises(M.MessageError, match="max_image_pixels") as e:  # the server would allocate it to warm up
        M.decode(M.encode(hello), lim)
    assert e.value.code == "oversized"
    hello = M.Envelope(hello=M.pb.Hello(action_dim=D_A, cameras=[f"c{i}" for i in range(20)]))
    with pytest.raises(M.MessageError, match="max_cameras"):
        M.decode(M.encode(hello), lim)
    hello = M.Envelope(hello=M.pb.Hello(action_dim=D_A, control_hz=float("inf")))
    with pytest.raises(M.MessageError, match="control_hz"):
        M.decode(M.encode(hello), lim)
    ready = M.Envelope(ready=M.pb.Ready(action_dim=D_A, chunk_size=0))
    with pytest.raises(M.MessageError, match="ready announces"):
        M.decode(M.encode(ready), lim)


def test_server_never_sends_a_nonfinite_chunk():
    class NaNPolicy(GoalPolicy):
        def sample(self, obs, generator=None):
            out = super().sample(obs, generator)
            return PolicySample(out.actions * float("nan"), out.log_prob)

    srv, th, robot_end, _ = _start_server(NaNPolicy())
    robot_end.send(_obs_env(request_id=3))
    err = _recv_kind(robot_end, "error").error
    assert err.code == "internal" and "NaN" in err.message and err.request_id == 3
    assert srv.stats["chunks"] == 0
    robot_end.close()


def test_observation_with_inconsistent_image_rejected():
    env = _obs_env()
    env.observation.images[0].height = 9
    with pytest.raises(M.MessageError, match="bytes"):
        M.decode(M.encode(env))
    with pytest.raises(M.MessageError, match="proprio"):
        M.decode(M.encode(_obs_env()), M.Limits(state_dim=4))


# ----------------------------------------------------------------------------- queue

def test_latency_aware_merge_skips_executed_and_overwrites_future():
    q = ActionQueue(2)
    q.insert(np.zeros((8, 2)), start_step=0, next_step=0)
    assert q.size(0) == 8
    new = np.arange(16, dtype=np.float32).reshape(8, 2) + 100
    res = q.insert(new, start_step=2, next_step=5)  # computed at step 2, arrives before step 5
    assert res.skipped == 3 and res.inserted == 5 and res.replaced == 3
    a, _ = q.pop(5)
    np.testing.assert_array_equal(a, new[3])  # step 5 = index 3 of the new chunk
    assert q.size(6) == 4
    np.testing.assert_array_equal(q.committed(6, 2), new[4:6])
    assert q.pop(100)[0] is None and q.size(100) == 0


def test_naive_merge_restarts_from_first_action():
    q = ActionQueue(2, merge="naive")
    new = np.arange(16, dtype=np.float32).reshape(8, 2)
    q.insert(new, start_step=2, next_step=5)
    np.testing.assert_array_equal(q.pop(5)[0], new[0])
    with pytest.raises(ValueError):
        q.insert(np.zeros((4, 3)), 0, 0)
    with pytest.raises(ValueError):
        ActionQueue(2, merge="blend")


def test_chunk_entirely_stale_adds_nothing():
    q = ActionQueue(1)
    res = q.insert(np.ones((4, 1)), start_step=0, next_step=10)
    assert res.inserted == 0 and q.size(10) == 0


# ----------------------------------------------------------------------------- safety

def test_clip_range_rate_and_nonfinite():
    f = SafetyFilter(SafetyLimits(low=-1, high=1, max_delta=0.25), 3)
    a, flags = f.clip(np.array([2.0, -3.0, 0.1]))
    np.testing.assert_allclose(a, [1.0, -1.0, 0.1])
    assert "range" in flags
    a, flags = f.clip(np.array([0.0, 0.0, 0.1]))
    np.testing.assert_allclose(a, [0.75, -0.75, 0.1])
    assert "rate" in flags
    a, flags = f.clip(np.array([np.nan, 0.0, 0.0]), hold=np.zeros(3))
    assert "nonfinite" in flags and np.isfinite(a).all()
    with pytest.raises(ValueError, match="D_a=3"):
        f.clip(np.zeros(4))


def test_clip_workspace_box():
    f = SafetyFilter(SafetyLimits(workspace_low=[-0.1, -0.1, 0.0], workspace_high=[0.1, 0.1, 0.2], pos_scale=0.05), 7)
    proprio = np.zeros(9, np.float32)
    proprio[:3] = [0.09, 0.0, 0.1]
    a, flags = f.clip(np.array([1.0, 0.5, 0, 0, 0, 0, 1.0]), proprio)
    assert "workspace" in flags
    np.testing.assert_allclose(proprio[0] + 0.05 * a[0], 0.1, atol=1e-6)  # stops on the face
    assert a[1] == pytest.approx(0.5) and a[6] == 1.0
    proprio[:3] = [0.15, 0.0, 0.1]  # outside: may move back in, not further out
    a, _ = f.clip(np.array([1.0, 0, 0, 0, 0, 0, 0]), proprio)
    assert a[0] == 0.0
    a, _ = f.clip(np.array([-1.0, 0, 0, 0, 0, 0, 0]), proprio)
    assert a[0] == -1.0


def test_clip_workspace_box_absolute_targets():
    # suite=ee: the translation is the target itself (m), clipped to the box; yaw and gripper kept
    f = SafetyFilter(SafetyLimits(low=[0.25, -0.35, -0.105, -3.2, -1.0], high=[0.85, 0.35, 0.35, 3.2, 1.0],
                                  workspace_low=[0.3, -0.2, -0.1], workspace_high=[0.7, 0.2, 0.2],
                                  mode="absolute"), 5)
    proprio = np.zeros(9, np.float32)
    a, flags = f.clip(np.array([0.5, 0.1, 0.0, 1.5, 1.0]), proprio)
    assert not flags
    np.testing.assert_allclose(a, [0.5, 0.1, 0.0, 1.5, 1.0])
    a, flags = f.clip(np.array([0.8, -0.3, 0.3, 1.5, -1.0]), proprio)
    assert "workspace" in flags
    np.testing.assert_allclose(a, [0.7, -0.2, 0.2, 1.5, -1.0], atol=1e-6)
    with pytest.raises(ValueError, match="mode"):
        SafetyFilter(SafetyLimits(mode="velocity"), 7)


def test_safety_range_follows_the_action_space():
    from omegaconf import OmegaConf

    from wmrl.kernel.types import PANDA_EE_YAW, PANDA_OSC_POSE
    from wmrl.run.robot import safety_limits

    node = OmegaConf.create({"low": None, "high": None, "max_delta": None, "workspace_low": None,
                             "workspace_high": None, "pos_scale": 0.05})
    ee = safety_limits(node, PANDA_EE_YAW.to_dict())
    assert ee.mode == "absolute" and ee.low == list(PANDA_EE_YAW.low) and ee.high == list(PANDA_EE_YAW.high)
    delta = safety_limits(node, PANDA_OSC_POSE.to_dict())
    assert delta.mode == "delta" and delta.low == [-1.0] * 7 and delta.high == [1.0] * 7
    node.low = -0.5  # an explicit range wins
    assert safety_limits(node, PANDA_OSC_POSE.to_dict()).low == -0.5


def test_sim_arm_holds_where_it_is_in_both_action_spaces():
    """ChunkEnvArm's hold: the zero delta in the OSC_POSE delta space, the current pose as the
    target in suite=ee's absolute space (a zero there would send the arm to the base origin)."""
    from robot_bridge.arm import ChunkEnvArm
    from sim.control import EeTargetControl
    from sim.env import SimEnv
    from sim.init_states import get
    from wmrl.kernel.types import Start

    for control, dim in ((None, 7), (EeTargetControl(), 5)):
        kw = {} if control is None else {"control": control}
        env = SimEnv(num_envs=1, init_states=get, cameras=(), image_size=(16, 16), auto_reset=False, **kw)
        arm = ChunkEnvArm(env, [Start(task_name="lift_red", instruction="lift", init_index=0, split="train")],
                          cameras=[], image_size=(16, 16))
        assert arm.gripper_dim == dim - 1
        arm.reset_episode(0)
        p0 = arm.observe()[0]
        h = arm.hold_action(None)
        assert h.shape == (dim,) and h[dim - 1] == -1.0
        for _ in range(16):
            arm.apply(arm.hold_action(None))
        moved = np.abs(arm.observe()[0][:3] - p0[:3]).max()
        assert moved < 5e-3, (dim, moved)  # ee: the init pose is turned to pointing down (~3 mm)
        if control is not None:
            np.testing.assert_allclose(h[:3], p0[:3], atol=1e-6)


def test_watchdog_fires_after_silence():
    now = [0.0]
    w = Watchdog(0.5, clock=lambda: now[0])
    now[0] = 0.4
    assert not w.expired()
    w.kick()
    now[0] = 0.8
    assert not w.expired()
    now[0] = 1.0
    assert w.expired()


# ----------------------------------------------------------------------------- real-time chunking

class TwoModeFlowPolicy:
    """Tiny flow policy in the convention of ``policies.samplers`` (``x_s = (1 - s) a + s eps``,
    ``v = eps - a``): data = two constant chunks (+0.8 / -0.8), exact velocity ``E[eps - a | x_s]``;
    real-time chunking with ``policies.rtc``."""

    chunk_size, action_dim, num_steps = 16, D_A, 10
    supports_rtc = True

    def __init__(self):
        self.modes = torch.stack([torch.full((16, D_A), 0.8), torch.full((16, D_A), -0.8)])
        self.calls: list[tuple] = []  # (prefix, delay) of each sample call

    def velocity(self, x, s):
        ss = s.view(-1, 1, 1).clamp_min(1e-3)
        d2 = ((x.unsqueeze(1) - (1 - s.view(-1, 1, 1, 1)) * self.modes[None]) ** 2).sum((2, 3))
        w = torch.softmax(-d2 / (2 * ss.view(-1, 1) ** 2), dim=1)
        return (x - (w.view(-1, 2, 1, 1) * self.modes[None]).sum(1)) / ss

    def sample(self, obs, generator=None, prefix=None, delay=0):
        self.calls.append((prefix, delay))
        noise = torch.randn(obs.batch_size, 16, D_A, generator=generator)
        return PolicySample(rtc_sample(self.velocity, noise, prefix, delay, self.num_steps), torch.zeros(obs.batch_size))

    def log_prob(self, obs, sample):
        return torch.zeros(obs.batch_size)


def test_server_uses_rtc_for_requests_with_prefix():
    pol = TwoModeFlowPolicy()
    srv = PolicyServer(pol)
    assert srv.supports_prefix
    env = _obs_env(prefix_actions=np.full((8, D_A), -0.8, np.float32))
    env.observation.delay_steps = 2
    env.observation.proprio[:] = [0.0] * D_S
    chunks = [srv.infer(env.observation) for _ in range(10)]
    assert all(c.shape == (16, D_A) for c in chunks)
    assert sum(c[2:].mean() < 0 for c in chunks) >= 9
    np.testing.assert_allclose(chunks[0][:2], -0.8)
    prefix, delay = pol.calls[-1]  # the server passes the committed actions and the delay, nothing else
    assert delay == 2 and torch.equal(prefix, torch.full((8, D_A), -0.8))


def test_server_without_rtc_samples_plainly():
    """``rtc=False``, or a policy that does not support RTC: no prefix is asked for (``Ready``) and
    a request's prefix is not passed to the policy."""
    env = _obs_env(prefix_actions=np.full((8, D_A), -0.8, np.float32))
    pol = TwoModeFlowPolicy()
    srv = PolicyServer(pol, rtc=False)
    assert not srv.supports_prefix
    srv.infer(env.observation)
    assert pol.calls == [(None, 0)]
    assert not PolicyServer(GoalPolicy()).supports_prefix


# ----------------------------------------------------------------------------- server / client

def _start_server(policy, delay=0.0, **kw):
    robot_end, server_end = InProcTransport.pair(M.Limits(action_dim=D_A), M.Limits(state_dim=D_S))
    srv = PolicyServer(policy, inference_delay_s=delay, **kw)
    th = threading.Thread(target=srv.serve, args=(server_end,), daemon=True)
    th.start()
    return srv, th, robot_end, server_end


def _recv_kind(t, kind, timeout=5.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        env = t.recv(timeout=0.1)
        if env is not None and M.kind(env) == kind:
            return env
    raise AssertionError(f"no {kind} within {timeout} s")


def test_server_rejects_malformed_and_oversized_and_stays_up():
    srv, th, robot_end, _ = _start_server(GoalPolicy())
    robot_end.send_bytes(b"\x0a\xff\xff not a protobuf")
    err = _recv_kind(robot_end, "error")
    assert err.error.code == "malformed"
    robot_end.send_bytes(b"\x00" * (5 * 1024 * 1024))
    assert _recv_kind(robot_end, "error").error.code == "oversized"
    bad = _obs_env()
    bad.observation.images[0].width = 3
    robot_end.send(bad)
    assert _recv_kind(robot_end, "error").error.code == "invalid"
    robot_end.send(_obs_env(request_id=7))  # the link is still up: a valid request is answered
    ch = _recv_kind(robot_end, "chunk")
    assert ch.chunk.request_id == 7 and ch.chunk.start_step == 3 and ch.chunk.action_dim == D_A
    assert srv.stats["rejected"] == 3
    robot_end.close()
    th.join(timeout=2)
    assert not th.is_alive()


def test_server_rejects_robot_with_other_action_dim():
    _, _, robot_end, _ = _start_server(GoalPolicy())
    robot_end.send(M.Envelope(hello=M.pb.Hello(action_dim=6, state_dim=D_S)))
    assert "D_a=6" in _recv_kind(robot_end, "error").error.message
    robot_end.close()


def test_repeated_hello_gets_the_same_ready_without_a_second_warmup():
    pol = GoalPolicy()
    calls = []
    sample = pol.sample
    pol.sample = lambda obs, generator=None: calls.append(1) or sample(obs, generator)
    _, _, robot_end, _ = _start_server(pol)
    for _ in range(2):
        robot_end.send(M.Envelope(hello=M.pb.Hello(action_dim=D_A, state_dim=D_S, cameras=["agentview"])))
    a, b = _recv_kind(robot_end, "ready").ready, _recv_kind(robot_end, "ready").ready
    assert a == b and len(calls) == 1
    robot_end.close()


def test_session_without_hello_times_out_even_when_it_sends_garbage():
    robot_end, server_end = InProcTransport.pair(M.Limits(action_dim=D_A), M.Limits(state_dim=D_S))
    srv = PolicyServer(GoalPolicy())
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("s", srv.serve(server_end, hello_timeout_s=0.3)), daemon=True)
    th.start()
    t0 = time.monotonic()
    while th.is_alive() and time.monotonic() - t0 < 30:
        robot_end.send_bytes(b"\x0a\xff garbage")  # rejected, answered, but not activity
        time.sleep(0.02)
    ended_while_garbage_flowed = not th.is_alive()  # garbage never reset the Hello deadline
    th.join(timeout=1)
    assert ended_while_garbage_flowed and box["s"]["ended"].startswith("timeout: no Hello within hello_timeout_s=0.3")
    assert box["s"]["rejected"] > 3
    codes = []
    while (env := robot_end.recv(timeout=0.05)) is not None:
        codes.append(env.error.code if M.kind(env) == "error" else M.kind(env))
    assert "timeout" in codes and "malformed" in codes


def test_client_rejects_chunk_of_wrong_dimension():
    robot_end, server_end = InProcTransport.pair(M.Limits(action_dim=D_A), M.Limits())
    arm = KinematicArm()
    cl = RobotClient(arm, robot_end, ClientConfig(max_steps=6, watchdog_s=5.0, stop_on_success=False))
    server_end.send(M.Envelope(ready=M.pb.Ready(action_dim=D_A, chunk_size=16)))
    cl.connect()
    server_end.send(M.make_chunk(actions=np.ones((16, 6)), start_step=0))
    server_end.send(M.make_chunk(actions=np.zeros((16, D_A)), start_step=0))  # still connected
    res = cl.run_episode(0)
    cl.close()
    assert cl.rejected and "action_dim=6" in cl.rejected[0]
    assert _recv_kind(server_end, "error").error.code == "invalid"
    # the wrong chunk (all ones) never reached the arm
    assert not np.any(res.episode.actions[:, :6] == 1.0)


def test_end_to_end_inprocess_reaches_goal_and_records():
    _, th, robot_end, _ = _start_server(GoalPolicy(), delay=0.1)
    arm = KinematicArm()
    cl = RobotClient(arm, robot_end, ClientConfig(max_steps=200))
    ready = cl.connect()
    assert ready.chunk_size == 16 and ready.warmup_s >= 0
    res = cl.run_episode(0)
    cl.close()
    assert res.success and res.failure_label == ""
    ep = res.episode
    assert ep.success and ep.actions.shape == (res.steps, D_A) and ep.proprio.shape == (res.steps, D_S)
    assert ep.images["agentview"].shape == (res.steps, 3, 16, 16)
    assert set(ep.extras) >= {"t_cmd", "starved", "cmd_latency_s"} and np.all(np.diff(ep.extras["t_cmd"]) > 0)
    assert len(res.latencies_s) >= 1 and res.time_to_first_action_s > 0


def test_frames_only_at_requests_reads_fewer_frames_and_marks_the_fresh_ones():
    _, th, robot_end, _ = _start_server(GoalPolicy(), delay=0.05)
    arm = KinematicArm()
    cl = RobotClient(arm, robot_end, ClientConfig(max_steps=200, frames="requests"))
    cl.connect()
    res = cl.run_episode(0)
    cl.close()
    assert res.success
    ep, fresh = res.episode, res.episode.extras["frame_fresh"]
    assert fresh[0] == 1 and int(fresh.sum()) == arm.frames_read == res.stats["requests"] < res.steps
    img = ep.images["agentview"]
    for t in np.flatnonzero(fresh == 0):  # a stale step repeats the frame of the step before it
        assert np.array_equal(img[t], img[t - 1])
    moved = [t for t in np.flatnonzero(fresh == 1)[1:] if not np.array_equal(img[t], img[t - 1])]
    assert moved  # the fresh frames are read anew (the arm moves between requests)


def test_a_slow_frame_read_does_not_make_its_request_look_overdue():
    """Frames that take 6 control periods to read (a slow renderer): the request decided before the
    read counts as in flight from when it left, so the next one is not sent at the very next step."""

    class SlowFrames(KinematicArm):
        def observe(self, images=True):
            if images:
                time.sleep(0.3)
            return super().observe(images)

    _, th, robot_end, _ = _start_server(TrackingPolicy(chunk_size=8), delay=0.005)
    arm = SlowFrames(goal=(5.0, 5.0, 5.0))
    cl = RobotClient(arm, robot_end, ClientConfig(max_steps=48, frames="requests", request_threshold=2,
                                                  stop_on_success=False))
    cl.connect()
    res = cl.run_episode(0)
    cl.close()
    fresh = np.flatnonzero(res.episode.extras["frame_fresh"])
    assert res.steps == 48 and len(fresh) <= 48 // 4
    assert not np.any(np.diff(fresh[1:]) == 1), fresh  # never two requests in a row (after the first chunk)


def test_frames_at_requests_needs_a_robot_that_declares_it():
    class EagerArm(KinematicArm):
        frames_on_demand = False

    robot_end, _ = InProcTransport.pair(M.Limits(action_dim=D_A), M.Limits(state_dim=D_S))
    with pytest.raises(ValueError, match="frames_on_demand"):
        RobotClient(EagerArm(), robot_end, ClientConfig(frames="requests"))
    with pytest.raises(ValueError, match="every_step"):
        RobotClient(KinematicArm(), robot_end, ClientConfig(frames="sometimes"))


def test_server_killed_robot_holds_then_watchdog_stops():
    srv, th, robot_end, server_end = _start_server(TrackingPolicy(), delay=0.05)
    arm = KinematicArm()
    cl = RobotClient(arm, robot_end, ClientConfig(max_steps=400, watchdog_s=0.3, stop_on_success=False))
    cl.connect()
    box = {}
    runner = threading.Thread(target=lambda: box.setdefault("r", cl.run_episode(0)))
    runner.start()
    time.sleep(1.0)
    srv.stop()  # server dies: no more chunks, no heartbeats
    th.join(timeout=2)
    t_dead = time.monotonic()
    runner.join(timeout=10)
    assert not runner.is_alive()
    res = box["r"]
    cl.close()
    assert res.failure_label == "watchdog" and not res.success
    assert arm.stopped and arm.stop_time >= t_dead
    ep = res.episode
    assert res.steps == ep.actions.shape[0] > 10 and ep.info["failure_label"] == "watchdog"
    assert ep.extras["starved"][-1] == 1.0  # it was holding when the watchdog fired
    held = ep.actions[ep.extras["starved"] == 1.0]
    np.testing.assert_allclose(held[:, :6], 0.0)  # holding = zero delta


def test_estop_stops_at_once_from_operator_and_from_server():
    for source in ("operator", "server"):
        srv, th, robot_end, server_end = _start_server(TrackingPolicy())
        arm = KinematicArm()
        cl = RobotClient(arm, robot_end, ClientConfig(max_steps=400, stop_on_success=False))
        cl.connect()
        box = {}
        runner = threading.Thread(target=lambda: box.setdefault("r", cl.run_episode(0)))
        runner.start()
        time.sleep(0.5)
        if source == "operator":
            cl.estop("test")
        else:
            srv.send_estop(server_end, "test")
        runner.join(timeout=5)
        n_applied = len(arm.applied)
        time.sleep(0.2)
        res = box["r"]
        cl.close()
        assert arm.stopped and res.failure_label == "estop" and "test" in res.episode.info["estop_reason"]
        assert len(arm.applied) == n_applied  # nothing executed after the stop


def test_operator_flag_labels_failure():
    _, _, robot_end, _ = _start_server(TrackingPolicy())
    arm = KinematicArm()
    cl = RobotClient(arm, robot_end, ClientConfig(max_steps=400, stop_on_success=False))
    cl.connect()
    timer = threading.Timer(0.3, cl.flag_failure, args=("dropped cube",))
    timer.start()
    res = cl.run_episode(0)
    cl.close()
    assert res.failure_label == "operator:dropped cube" and res.episode.info["failure_source"] == "operator"


def test_critic_labels_failure_when_predicate_false():
    _, _, robot_end, _ = _start_server(TrackingPolicy())
    arm = KinematicArm(goal=(5.0, 5.0, 5.0))
    cl = RobotClient(arm, robot_end, ClientConfig(max_steps=5), critic=lambda p, imgs: 0.1)
    cl.connect()
    res = cl.run_episode(0)
    cl.close()
    assert res.failure_label == "critic" and res.stats["critic_success_prob"] == pytest.approx(0.1)


def test_obs_conversion_for_policy():

    o = obs_from_message(_obs_env().observation)
    assert isinstance(o, Obs) and o.validate().images["agentview"].shape == (1, 3, 8, 8)
