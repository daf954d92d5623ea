"""Bridge faults a robot meets in deployment, over gRPC (127.0.0.1) and ROS 2 (Cyclone DDS,
loopback-only): a client that only sends heartbeats, a second robot beyond ``max_sessions``,
non-finite / huge / over-long RTC prefixes, the policy server killed and restarted, and no policy
server at all (``wmrl robot``: one line). Short timeouts throughout; every wait is bounded."""

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from robot_bridge import messages as M
from robot_bridge.arm import run_node
from robot_bridge.client import ClientConfig, ReconnectPolicy, RobotClient, episode_ran
from robot_bridge.server import PolicyServer, SessionLimits
from robot_bridge.testing import GoalPolicy, KinematicArm

grpc_transport = pytest.importorskip("robot_bridge.transports.grpc_transport")
ros2 = pytest.importorskip("robot_bridge.transports.ros2")

D_A, D_S, H = 7, 9, 16
REPO = Path(__file__).resolve().parents[1]
KINDS = ["grpc", "ros2"]
_DOMAIN = [200 + os.getpid() % 16]


class Bridge:
    """A policy server (``serve_endpoint`` in a thread) on gRPC or ROS 2 that can be killed and
    restarted on the same address / domain, and robot-side transports to it."""

    def __init__(self, kind: str, limits: SessionLimits | None = None, start: bool = True):
        self.kind = kind
        self.limits = limits or SessionLimits(hello_timeout_s=5.0, idle_timeout_s=30.0)
        self.address = "127.0.0.1:0"
        _DOMAIN[0] += 1
        self.domain = _DOMAIN[0]
        self.server = None
        if start:
            self.start()

    def start(self) -> None:
        lim = M.Limits(state_dim=D_S)
        if self.kind == "grpc":
            self.endpoint = grpc_transport.GrpcServer(self.address, lim)
            self.address = self.endpoint.address
        else:
            self.endpoint = ros2.Ros2Transport("server", domain_id=self.domain, limits=lim)
        self.server = PolicyServer(GoalPolicy(chunk_size=H))
        self.thread = threading.Thread(target=self.server.serve_endpoint, args=(self.endpoint, self.limits),
                                       daemon=True)
        self.thread.start()

    def kill(self) -> None:
        """The server goes away: no more chunks, heartbeats or sessions."""
        if self.server is None:
            return
        self.server.stop()
        self.thread.join(timeout=5)
        if self.kind == "grpc":
            self.endpoint.stop(0)
        else:
            self.endpoint.close()

    def open(self, connect_timeout_s: float = 2.0):
        """A robot-side transport (``ConnectionError`` when no server is there)."""
        lim = M.Limits(action_dim=D_A)
        if self.kind == "grpc":
            return grpc_transport.GrpcClientTransport(self.address, lim, connect_timeout_s=connect_timeout_s)
        return ros2.Ros2Transport("robot", domain_id=self.domain, limits=lim, connect_timeout_s=connect_timeout_s)


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def _recv_until(t, pred, timeout=5.0):
    """The first message ``pred(env)`` accepts (``MessageError`` counts as a message)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        try:
            env = t.recv(timeout=0.05)
        except M.MessageError as e:
            env = e
        if env is not None and pred(env):
            return env
    raise AssertionError(f"nothing matching within {timeout} s")


def _is(kind):
    return lambda env: isinstance(env, M.Envelope) and M.kind(env) == kind


def _heartbeats(t, stop: threading.Event, period_s=0.05):
    while not stop.wait(period_s):
        try:
            t.send(M.Envelope(heartbeat=M.pb.Heartbeat(stamp_ns=M.now_ns())))
        except (ConnectionError, OSError):
            return


# ----------------------------------------------------------------------------- sessions


def test_heartbeat_only_client_does_not_delay_a_robots_ready(kind):
    """A client that only heart-beats holds no robot back (its own session), and is ended with
    [timeout] once it has said no Hello for hello_timeout_s."""
    br = Bridge(kind, SessionLimits(max_sessions=4, hello_timeout_s=4.0))
    idler = br.open()
    stop = threading.Event()
    threading.Thread(target=_heartbeats, args=(idler, stop), daemon=True).start()
    try:
        time.sleep(0.3)  # the heart-beating client is connected first
        arm = KinematicArm()
        cl = RobotClient(arm, br.open(), ClientConfig(max_steps=10, stop_on_success=False, ready_timeout_s=10))
        cl.connect()
        timeouts_at_ready = br.server.stats["timeouts"]
        res = cl.run_episode(0)
        cl.close()
        assert timeouts_at_ready == 0, "Ready came only after the heartbeat-only client was timed out"
        assert res.steps == 10 and len(res.latencies_s) >= 1  # chunks flowed
        err = _recv_until(idler, _is("error"), timeout=5)
        assert err.error.code == "timeout" and "Hello" in err.error.message
    finally:
        stop.set()
        idler.close()
        br.kill()
    assert br.server.stats["timeouts"] >= 1


def test_robot_beyond_max_sessions_is_told_busy_or_waits(kind):
    br = Bridge(kind, SessionLimits(max_sessions=1, on_busy="reject"))
    first = RobotClient(KinematicArm(), br.open(), ClientConfig(ready_timeout_s=10))
    second = None
    try:
        first.connect()
        second = RobotClient(KinematicArm(), br.open(), ClientConfig(ready_timeout_s=10))
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=r"\[busy\].*max_sessions=1"):
            second.connect()
        assert time.monotonic() - t0 < 5.0  # told at once, not after ready_timeout_s=10
        assert first.link_up  # the served robot is not disturbed
    finally:
        first.close()
        if second is not None:
            second.close()
        br.kill()
    assert br.server.stats["busy"] == 1

    br = Bridge(kind, SessionLimits(max_sessions=1, on_busy="queue"))
    first = RobotClient(KinematicArm(), br.open(), ClientConfig(ready_timeout_s=10))
    try:
        first.connect()
        second = RobotClient(KinematicArm(), br.open(), ClientConfig(ready_timeout_s=10))
        threading.Timer(0.5, first.close).start()  # the first robot leaves: the queued one is served
        t0 = time.monotonic()
        second.connect()
        assert 0.4 < time.monotonic() - t0 < 5.0
    finally:
        second.close()
        br.kill()


# ----------------------------------------------------------------------------- RTC prefix validation


def _request(rid: int, prefix=None, delay: int = 0) -> M.Envelope:
    env = M.make_observation(episode=0, step=3, proprio=np.zeros(D_S, np.float32),
                             images={c: np.zeros((8, 8, 3), np.uint8) for c in ("agentview", "robot0_eye_in_hand")},
                             request=True, request_id=rid, prefix_actions=prefix)
    env.observation.delay_steps = delay
    return env


BAD_PREFIXES = {
    "nan": (np.full((4, D_A), np.nan, np.float32), 1, "NaN or inf"),
    "inf": (np.full((4, D_A), np.inf, np.float32), 1, "NaN or inf"),
    "huge": (np.full((4, D_A), 1e30, np.float32), 1, "magnitude 1e\\+30 > max_abs_value"),
    "over_long": (np.zeros((H + 1, D_A), np.float32), 1, f"prefix_len={H + 1} actions is longer than the chunk length H={H}"),
    "delay_past_chunk": (np.zeros((2, D_A), np.float32), H + 1, f"delay_steps={H + 1} exceeds the chunk length H={H}"),
}


def test_bad_rtc_prefixes_are_refused_and_the_stream_kept(kind):
    br = Bridge(kind)
    t = br.open()
    try:
        t.send(M.Envelope(hello=M.pb.Hello(action_dim=D_A, state_dim=D_S)))
        _recv_until(t, _is("ready"))
        for rid, (name, (prefix, delay, why)) in enumerate(BAD_PREFIXES.items(), start=1):
            t.send(_request(rid, prefix, delay))
            got = _recv_until(t, lambda e: isinstance(e, M.Envelope) and M.kind(e) in ("error", "chunk"))
            assert M.kind(got) == "error", f"{name}: the server answered a {M.kind(got)}"
            assert got.error.code == "invalid" and got.error.request_id == rid, name
            assert re.search(why, got.error.message), (name, got.error.message)
        t.send(_request(99, np.full((4, D_A), 0.5, np.float32), 2))  # the stream is still up
        ch = _recv_until(t, _is("chunk")).chunk
        assert ch.request_id == 99 and np.isfinite(M.chunk_array(ch)).all()
    finally:
        t.close()
        br.kill()
    assert br.server.stats["chunks"] == 1 and br.server.stats["rejected"] == len(BAD_PREFIXES)


# ----------------------------------------------------------------------------- server killed, restarted


def _watch_and_restart(br: Bridge, arm: KinematicArm, box: dict, restart_after_s: float | None):
    t_end = time.monotonic() + 10
    while len(arm.applied) < 8 and time.monotonic() < t_end:  # well into episode 0
        time.sleep(0.01)
    box["t_kill"] = time.monotonic()
    br.kill()
    if restart_after_s is not None:
        time.sleep(restart_after_s)
        br.start()


def test_server_killed_and_restarted_robot_reconnects_and_finishes(kind):
    br = Bridge(kind)
    arm = KinematicArm()
    cfg = ClientConfig(max_steps=30, watchdog_s=0.3, stop_on_success=False, ready_timeout_s=10)
    box = {}
    killer = threading.Thread(target=_watch_and_restart, args=(br, arm, box, 1.0), daemon=True)
    killer.start()
    try:
        rep = run_node(arm, None, 3, cfg, progress=False, transport_factory=lambda: br.open(connect_timeout_s=0.5),
                       reconnect=ReconnectPolicy(attempts=20, backoff_s=0.1, backoff_max_s=0.4, give_up_after_s=15))
    finally:
        killer.join(timeout=10)
        br.kill()
    labels = [r["failure_label"] for r in rep["episodes"]]
    assert labels[0] == "watchdog" and len(labels) == 3 and all(episode_ran(x) for x in labels[1:]), labels
    assert rep["episodes"][1]["steps"] == rep["episodes"][2]["steps"] == 30
    assert rep["episodes_lost"] == [0] and not rep["all_ran"] and rep["gave_up"] is None
    assert len(rep["reconnects"]) == 1 and rep["reconnects"][0]["before_episode"] == 1
    assert rep["reconnects"][0]["connect_s"] < 5.0


def test_ros2_hello_is_repeated_until_a_late_server_answers():
    """A killed ROS 2 server stays discovered until its lease expires: a reconnecting robot's first
    Hello can go to it alone. Stand-in: an endpoint nobody serves; the real server starts later."""
    br = Bridge("ros2", start=False)
    dead = ros2.Ros2Transport("server", domain_id=br.domain, limits=M.Limits(state_dim=D_S))
    cl = RobotClient(KinematicArm(), br.open(connect_timeout_s=5), ClientConfig(ready_timeout_s=10, hello_retry_s=0.3))
    try:
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("ready", cl.connect()), daemon=True)
        th.start()
        time.sleep(0.8)  # the first Hello went to the dead endpoint only
        br.start()
        th.join(timeout=5)
        assert "ready" in box, "no Ready from a server that started after the first Hello"
    finally:
        cl.close()
        dead.close()
        br.kill()


def test_server_that_does_not_come_back_loses_the_remaining_episodes(kind):
    br = Bridge(kind)
    arm = KinematicArm()
    cfg = ClientConfig(max_steps=30, watchdog_s=0.3, stop_on_success=False, ready_timeout_s=10)
    box = {}
    killer = threading.Thread(target=_watch_and_restart, args=(br, arm, box, None), daemon=True)
    killer.start()
    t0 = time.monotonic()
    rep = run_node(arm, None, 3, cfg, progress=False, transport_factory=lambda: br.open(connect_timeout_s=0.3),
                   reconnect=ReconnectPolicy(attempts=2, backoff_s=0.1, backoff_max_s=0.2))
    killer.join(timeout=5)
    assert time.monotonic() - t0 < 10
    assert [r["failure_label"] for r in rep["episodes"]] == ["watchdog"]
    assert rep["episodes_lost"] == [0, 1, 2] and not rep["all_ran"]
    assert "gave up after 3 attempts" in rep["gave_up"] and "policy server" in rep["gave_up"]


def test_connect_with_retry_backs_off_and_gives_up():
    calls = []

    def factory():
        calls.append(time.monotonic())
        raise ConnectionError("no gRPC policy server at 127.0.0.1:1 within 0 s")

    cl = RobotClient(KinematicArm(), None, transport_factory=factory)
    with pytest.raises(ConnectionError, match="gave up after 4 attempts"):
        cl.connect_with_retry(ReconnectPolicy(attempts=3, backoff_s=0.05, backoff_max_s=0.1))
    waits = np.diff(calls)
    assert len(calls) == 4 and waits[0] >= 0.05 and waits[1] >= 0.1 and waits[2] >= 0.1 and waits[2] < 0.5
    calls.clear()
    with pytest.raises(ConnectionError) as e:
        cl.connect_with_retry(ReconnectPolicy(attempts=0))
    assert len(calls) == 1 and "gave up" not in str(e.value)  # one try, its own message
    with pytest.raises(ConnectionError, match="gave up after 2 attempts"):
        cl.connect_with_retry(ReconnectPolicy(attempts=50, backoff_s=0.2, backoff_max_s=0.2, give_up_after_s=0.3))


# ----------------------------------------------------------------------------- no server: `wmrl robot`


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", KINDS)
def test_robot_without_server_says_so_in_one_line(transport, tmp_path):
    where = f"transport.address=127.0.0.1:{_free_port()}" if transport == "grpc" else "transport.domain_id=231"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "wmrl.cli", "robot", f"transport={transport}", where,
                           "arm.kind=target", "reconnect.attempts=0", "transport.connect_timeout_s=0.7",
                           f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(err) == 1, proc.stderr
    assert err[0].startswith("wmrl robot: no ") and "policy server" in err[0]
    assert (where.split("=")[1] in err[0]) if transport == "grpc" else ("domain 231" in err[0])
    assert f"wmrl serve transport={transport}" in err[0]  # what to start / change
    assert "Traceback" not in proc.stdout + proc.stderr and "Error executing job" not in proc.stdout + proc.stderr
    # one try, waiting the configured connect timeout once (not doubled, not retried)
    assert "within 0.7 s" in err[0], err[0]
    assert not (tmp_path / "episodes").exists()  # no empty EpisodeStore left behind
