"""Request timing of the robot client (``robot_bridge.timing``) on a fake clock, the server's record
of the chunks in flight (``robot_bridge.plan``), the queue's newest-observation-wins merge, the
injected delay modes, and the safe fallback recorded in the episode.

The timing tests simulate the control loop tick by tick with a fake clock (no sleeps): every
request's chunk arrives a chosen round trip after it was sent, and is merged into a real
``ActionQueue`` before the next tick, as the client's receiver thread does. They assert what the
timer does, never how long anything took.
"""

import math
import threading
import time

import numpy as np
import pytest
import torch

from robot_bridge import messages as M
from robot_bridge.client import ClientConfig, RobotClient
from robot_bridge.plan import SessionPlan
from robot_bridge.queue import ActionQueue
from robot_bridge.server import PolicyServer
from robot_bridge.testing import KinematicArm, TrackingPolicy
from robot_bridge.timing import LatencyEstimate, RequestTimer, TimingConfig
from robot_bridge.transports.inproc import InProcTransport
from wmrl.kernel.types import Obs, PolicySample

H, DT, D_A, D_S = 16, 0.05, 7, 9


def simulate(round_trip, steps=400, dt=DT, serial=False, **cfg):
    """Run the timer for ``steps`` ticks. The ``i``-th request's chunk arrives ``round_trip(i)`` s
    after it was sent (a server whose delays overlap), or, with ``serial``, ``round_trip(i)`` is
    its compute time on a server that computes one request at a time (it reports its wait as
    ``queue_s``). Returns a dict: ``requests`` (step, delay_steps, in flight, supply left at that
    step), ``first`` (first step with an action), ``starved`` (steps after it without one),
    ``fallback``, ``timer``, ``arrivals`` (step at which each chunk came in)."""
    timer = RequestTimer(TimingConfig(chunk_size=H, **cfg), LatencyEstimate(16))
    timer.begin_episode(dt)
    q = ActionQueue(1)
    pending, out = [], {"requests": [], "first": None, "starved": [], "fallback": None, "arrivals": []}
    now, server_free = 0.0, 0.0
    for k in range(steps):
        for p in sorted(p for p in pending if p[0] <= now):  # the receiver thread, between ticks
            pending.remove(p)
            arrive, rid, s, sent, wait, compute = p
            timer.answered(rid)
            timer.measured(arrive - sent, wait, compute, arrive)
            q.insert(np.full((H, 1), s, np.float32), s, k)
            out["arrivals"].append(k)
        left = timer.supply_end(k + q.size(k) - 1, now) + 1 - k
        req = timer.due(k, k + q.size(k) - 1, now)
        if req is not None:
            c = round_trip(len(out["requests"]))
            if serial:
                start = max(now, server_free)
                server_free = start + c
                pending.append((server_free, req.request_id, k, now, start - now, c))
            else:
                pending.append((now + c, req.request_id, k, now, 0.0, 0.001))
            out["requests"].append((k, req.delay_steps, req.inflight, left))
        fb = timer.check_fallback(k)
        if fb is not None:
            out["fallback"] = fb
        a, _ = q.pop(k)
        if a is None and out["first"] is not None:
            out["starved"].append(k)
        elif a is not None and out["first"] is None:
            out["first"] = k
        now += timer.dt
    out["timer"] = timer
    return out


def _steps(latency_s: float) -> int:
    return math.floor(latency_s / DT) + 1


@pytest.mark.parametrize("latency", [0.05, 0.15, 0.3, 0.4, 0.5])
def test_requests_go_out_when_the_estimate_says_they_must(latency):
    """Up to 500 ms at 20 Hz with chunks of 16 (800 ms): no tick after the first action is without
    an action; once measured, a request goes out exactly when the actions left (queued and in
    flight) fall to ``max(threshold, R + m)``, so requests come every ``H - max(threshold, R + m)``
    steps, more than one in flight when the round trip exceeds what is left, and each carries the
    estimated delay ``R``."""
    rt = latency + 0.003  # the bridge's own few ms
    res = simulate(lambda i: rt, request_threshold=8, margin_steps=1, max_inflight=4)
    r = _steps(rt)
    due_at = max(8, r + 1)
    assert res["first"] is not None and res["starved"] == []
    warm = [q for q in res["requests"] if q[0] > 60]
    assert warm and all(left == due_at and delay == r for _, delay, _, left in warm)
    gaps = set(np.diff([q[0] for q in warm]))
    assert gaps == {H - due_at}
    most_inflight = max(n for _, _, n, _ in warm)
    assert most_inflight == math.ceil(r / (H - due_at))
    assert (most_inflight > 1) == (r + 1 > 8)
    assert res["fallback"] is None


def test_never_two_requests_for_the_same_step():
    timer = RequestTimer(TimingConfig(chunk_size=H, max_inflight=8, request_timeout_s=1.0))
    timer.begin_episode(DT)
    first = timer.due(5, 4, now=0.0)
    assert first is not None and first.step == 5
    assert timer.due(5, 4, now=0.0) is None  # the same step again, queue still dry
    assert timer.due(4, 3, now=0.0) is None  # nor an earlier one
    assert timer.due(5, 4, now=10.0) is None and timer.timeouts == 1  # timed out: still not the same step
    again = timer.due(6, 5, now=10.0)
    assert again is not None and again.step == 6 and again.request_id != first.request_id
    rng = np.random.default_rng(0)
    res = simulate(lambda i: 0.45 + rng.uniform(0.0, 0.1) + (1.5 if i % 17 == 5 else 0.0), max_inflight=4)
    steps = [q[0] for q in res["requests"]]
    assert len(steps) > 50 and len(set(steps)) == len(steps) and steps == sorted(steps)


def test_the_estimate_survives_one_slow_outlier_and_a_cold_first_call():
    est = LatencyEstimate(window=16)
    assert est.value_s is None
    for _ in range(10):
        est.add(0.3)
    est.add(2.0)
    assert est.value_s == pytest.approx(0.3)  # one slow round trip is ignored
    est.add(2.0)
    assert est.value_s == pytest.approx(2.0)  # two are believed
    for _ in range(16):
        est.add(0.3)
    assert est.value_s == pytest.approx(0.3)  # and forgotten once out of the window
    # in the loop: one 2 s round trip among 400 ms ones changes neither the delay nor the cadence
    res = simulate(lambda i: 2.0 if i == 30 else 0.403)
    r = _steps(0.403)
    after = [q for q in res["requests"] if q[0] > res["requests"][30][0]]
    assert all(delay == r for _, delay, _, _ in after) and res["fallback"] is None
    assert set(np.diff([q[0] for q in after])) == {H - (r + 1)}
    # a cold first call (2 s) does not decide a fallback, and the robot is never without actions
    cold = simulate(lambda i: 2.0 if i == 0 else 0.403)
    assert cold["fallback"] is None and cold["starved"] == []
    assert cold["timer"].estimate.value_s == pytest.approx(0.403)


def test_before_the_first_measurement_a_long_wait_brings_the_next_request_forward():
    """With no round trip measured yet, one taken to be twice the age of the oldest request in
    flight: at 500 ms a second request goes out at step 5 (twice its age then exceeds what chunk 0
    leaves), at most 3 are in flight before the first chunk, and the robot is never without an
    action; a fast server costs no extra request."""
    slow = simulate(lambda i: 0.503)
    cold = [q for q in slow["requests"] if q[0] < slow["arrivals"][0]]
    assert [q[0] for q in cold] == [0, 5, 7] and slow["starved"] == []
    fast = simulate(lambda i: 0.053)
    assert [q[0] for q in fast["requests"][:2]] == [0, 8]


def test_a_server_that_computes_one_request_at_a_time_gets_no_standing_queue():
    """On a serial server (one request at a time, its wait reported as ``queue_s``) the estimate
    stays the round trip of an idle server, requests are not sent while the server is still busy
    with earlier ones, and 300 ms of compute is kept up with; 500 ms is not (a chunk per 500 ms
    of which 5 of 16 actions are still ahead): the fallback is decided, and ``slow`` keeps up."""
    ok = simulate(lambda i: 0.3, serial=True)
    assert ok["starved"] == [] and ok["fallback"] is None
    assert ok["timer"].estimate.value_s == pytest.approx(0.3)
    waits = [s for s, *_ in ok["requests"][3:]]
    assert min(np.diff(waits)) >= ok["timer"].service_steps()
    slow = simulate(lambda i: 0.5, serial=True, fallback="slow")
    fb = slow["fallback"]
    assert fb is not None and fb.compute_s == pytest.approx(0.5) and fb.keeps_up_after
    assert [s for s in slow["starved"] if s > fb.step + 2 * H] == []


@pytest.mark.parametrize("mode", ["hold", "slow"])
def test_fallback_is_decided_when_no_timing_keeps_up(mode):
    """660 ms at 20 Hz (R = 14 of 16 steps): no schedule keeps up with 4 in flight. The fallback is
    decided once, only after ``min_samples`` round trips; ``slow`` halves the rate, after which
    requests keep up again (no tick without an action once the new schedule runs)."""
    res = simulate(lambda i: 0.66, fallback=mode, slow_factor=2.0, min_samples=3)
    fb = res["fallback"]
    assert fb is not None and fb.mode == mode and fb.latency_steps == 14
    assert fb.step >= res["arrivals"][2]  # not before 3 round trips were measured
    assert fb.control_hz_before == pytest.approx(20.0)
    if mode == "slow":
        assert fb.control_hz_after == pytest.approx(10.0) and fb.keeps_up_after
        assert res["timer"].dt == pytest.approx(0.1)
        assert [s for s in res["starved"] if s > fb.step + 2 * H] == []
    else:
        assert fb.control_hz_after == pytest.approx(20.0) and not fb.keeps_up_after
        assert res["timer"].dt == pytest.approx(DT) and res["starved"]
    assert simulate(lambda i: 0.503, fallback=mode)["fallback"] is None


def test_timing_settings_are_checked():
    for bad in ({"fallback": "brake"}, {"slow_factor": 1.0}, {"max_inflight": 0}):
        with pytest.raises(ValueError):
            TimingConfig(**bad)
    with pytest.raises(ValueError, match="fallback"):
        RobotClient(KinematicArm(), InProcTransport.pair()[0], ClientConfig(fallback="brake"))


def test_queue_keeps_the_newest_observation_whatever_the_order_of_arrival():
    q = ActionQueue(1)
    q.insert(np.full((8, 1), 4.0), start_step=4, next_step=2)
    res = q.insert(np.full((8, 1), 0.0), start_step=0, next_step=2)  # older, arrived late
    assert res.skipped == 2 and res.inserted == 2 and res.superseded == 4  # steps 4..7 keep the newer chunk
    np.testing.assert_array_equal(q.committed(2)[:, 0], [0, 0] + [4] * 8)


# ----------------------------------------------------------------------------- the server's record


def test_session_plan_continues_the_chunks_in_flight():
    plan = SessionPlan()
    assert plan.compose(0, 0, None, H) is None
    a = np.arange(H, dtype=np.float32)[:, None] + 100  # chunk of the request at step 0
    plan.record(0, 0, a)
    committed = np.array([[104.0], [105.0], [106.0]], np.float32)  # the robot still has 3 actions of chunk -1
    p = plan.compose(0, 4, committed, H)  # request at step 4, chunk 0 not received yet
    np.testing.assert_array_equal(p[:, 0], a[4:, 0])  # 12 actions: what the robot will hold
    b = np.full((H, 1), 7.0, np.float32)
    plan.record(0, 4, b)
    np.testing.assert_array_equal(plan.compose(0, 6, None, H)[:, 0], [7.0] * 14)
    assert plan.mismatches == 0
    assert plan.compose(1, 0, None, H) is None  # another episode: a new record
    plan.record(1, 0, a)
    assert plan.compose(1, 0, None, H) is None  # a step not after the last request: a new record too


class PrefixRecordingPolicy:
    """Deterministic RTC policy: the frozen prefix, then ``10 * (call number)``; records what it was given."""

    chunk_size, action_dim, supports_rtc = H, D_A, True

    def __init__(self):
        self.calls: list[tuple] = []

    def sample(self, obs, generator=None, prefix=None, delay=0):
        self.calls.append((None if prefix is None else prefix.clone(), delay))
        a = torch.full((1, H, D_A), 10.0 * len(self.calls))
        if prefix is not None:
            a[0, :delay] = prefix[:delay]
        return PolicySample(a, torch.zeros(1))

    def log_prob(self, obs, sample):
        return torch.zeros(obs.batch_size)


def _request(step, rid, delay, prefix=None, episode=0):
    env = M.make_observation(episode=episode, step=step, proprio=np.zeros(D_S, np.float32),
                             images={"agentview": np.zeros((8, 8, 3), np.uint8)}, request=True, request_id=rid,
                             prefix_actions=prefix)
    env.observation.delay_steps = delay
    return env


def _recv(t, kind, n=1):
    got = []
    for _ in range(2000):
        env = t.recv(timeout=0.05)
        if env is not None and M.kind(env) == kind:
            got.append(env)
            if len(got) == n:
                return got
    raise AssertionError(f"fewer than {n} {kind} messages")


def test_server_answers_an_overlapping_request_with_the_chunk_in_flight_as_prefix():
    pol = PrefixRecordingPolicy()
    robot_end, server_end = InProcTransport.pair(M.Limits(action_dim=D_A), M.Limits(state_dim=D_S))
    srv = PolicyServer(pol, limits=M.Limits(state_dim=D_S))
    threading.Thread(target=srv.serve, args=(server_end,), daemon=True).start()
    try:
        robot_end.send(_request(0, 1, delay=10))  # nothing committed yet
        robot_end.send(_request(4, 2, delay=10, prefix=np.full((2, D_A), 3.0, np.float32)))  # sent before chunk 1 came
        c1, c2 = (M.chunk_array(e.chunk) for e in _recv(robot_end, "chunk", 2))
    finally:
        robot_end.close()
    assert pol.calls[0][0] is None  # the first request: plain sampling
    prefix, delay = pol.calls[1]
    np.testing.assert_array_equal(prefix.numpy(), c1[4:])  # chunk 1 from step 4 on, not the robot's 2 actions
    assert delay == 10
    np.testing.assert_array_equal(c2[:10], c1[4:14])  # the frozen steps continue chunk 1 exactly


def _events_policy_server(delay_mode, delay_s):
    """Server with a policy and a transport that log ``("sample", perf_counter s)`` and ``("sent",
    request id)``."""
    events: list[tuple] = []
    pol = TrackingPolicy(chunk_size=H, rtc=False)
    sample = pol.sample
    pol.sample = lambda obs, generator=None: events.append(("sample", time.perf_counter())) or sample(obs, generator)
    robot_end, server_end = InProcTransport.pair(M.Limits(action_dim=D_A), M.Limits(state_dim=D_S))
    send = server_end.send

    def logged_send(env):
        if M.kind(env) == "chunk":
            events.append(("sent", env.chunk.request_id))
        send(env)

    server_end.send = logged_send
    srv = PolicyServer(pol, inference_delay_s=delay_s, delay_mode=delay_mode, limits=M.Limits(state_dim=D_S))
    threading.Thread(target=srv.serve, args=(server_end,), daemon=True).start()
    return events, robot_end


def _two_requests(delay_mode, delay_s):
    events, robot_end = _events_policy_server(delay_mode, delay_s)
    try:
        robot_end.send(_request(0, 1, delay=0))
        robot_end.send(_request(1, 2, delay=0))
        chunks = _recv(robot_end, "chunk", 2)
    finally:
        robot_end.close()
    return events, chunks


def test_latency_mode_overlaps_the_delays_of_requests_in_flight_compute_mode_takes_turns():
    """``latency``: both requests are computed before either chunk is sent (their delays overlap),
    and each chunk waited out its own delay. ``compute``: the delay holds the policy, so the second
    policy call starts only once the first call's delay is over (a lower bound a sleep guarantees)."""
    events, chunks = _two_requests("latency", 1.0)
    assert [e[0] for e in events] == ["sample", "sample", "sent", "sent"]
    assert all(c.chunk.inference_s >= 1.0 for c in chunks)
    events, _ = _two_requests("compute", 0.25)
    starts = [t for kind, t in events if kind == "sample"]
    assert len(starts) == 2 and starts[1] - starts[0] >= 0.25
    with pytest.raises(ValueError, match="delay_mode"):
        PolicyServer(TrackingPolicy(), delay_mode="sleep")


def test_tracking_policy_rtc_continues_its_own_plan():
    pol = TrackingPolicy(chunk_size=H)
    arm = KinematicArm(start=(0.0, 0.0, 0.0))
    p, _ = arm.observe()
    obs = Obs({}, torch.from_numpy(p)[None], [""])
    a0 = pol.sample(obs).actions[0]
    for i in range(4):
        arm.apply(a0[i].numpy())
    p4, _ = arm.observe()
    a1 = pol.sample(Obs({}, torch.from_numpy(p4)[None], [""]), prefix=a0[4:], delay=6).actions[0]
    torch.testing.assert_close(a1[:6], a0[4:10])  # frozen
    torch.testing.assert_close(a1[6:12], a0[10:16], atol=1e-5, rtol=0)  # planned on from where the prefix leads


# ----------------------------------------------------------------------------- fallback in the episode record


@pytest.mark.parametrize("mode", ["hold", "slow"])
def test_fallback_decision_is_recorded_in_the_episode(mode, tmp_path):
    """A round trip of at least 400 ms at 50 Hz (chunks of 16 = 320 ms) cannot be kept up with;
    the episode record says which safe behaviour ran, from which step and at which rate, and so
    does the EpisodeStore it is appended to."""
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.kernel.types import PANDA_OSC_POSE

    robot_end, server_end = InProcTransport.pair(M.Limits(action_dim=D_A), M.Limits(state_dim=D_S))
    srv = PolicyServer(TrackingPolicy(chunk_size=H, dt=0.02), inference_delay_s=0.4, limits=M.Limits(state_dim=D_S))
    threading.Thread(target=srv.serve, args=(server_end,), daemon=True).start()
    arm = KinematicArm(dt=0.02)
    cl = RobotClient(arm, robot_end, ClientConfig(control_hz=50.0, max_steps=60, stop_on_success=False,
                                                  fallback=mode, slow_factor=2.0, watchdog_s=5.0))
    cl.connect()
    res = cl.run_episode(0)
    cl.close()
    info = res.episode.info
    assert info["fallback"] == mode and res.stats["fallback"]["mode"] == mode
    d = info["fallback_decision"]
    assert d["control_hz_before"] == pytest.approx(50.0) and 0 < d["step"] < 60 and d["latency_s"] >= 0.4
    assert info["control_hz_effective"] == pytest.approx(25.0 if mode == "slow" else 50.0)
    store = EpisodeStore.create(tmp_path / "eps", cameras={c: arm.image_size for c in arm.cameras}, state_dim=D_S,
                                action_dim=D_A, fps=50.0, action_space=PANDA_OSC_POSE)
    back = store.episode(store.append(res.episode)).info
    assert back["fallback"] == mode and back["fallback_decision"]["step"] == d["step"]
