"""`wmrl robot` / `wmrl serve`: episodes recorded into the EpisodeStore, separate processes over
gRPC on 127.0.0.1, and the crash case (server killed mid-episode)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_module

from wmrl.run.common import RunContext

REPO = Path(__file__).resolve().parents[1]


def _cfg(name, overrides):
    with initialize_config_module(config_module="configs", version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_robot_node_inproc_records_every_episode(tmp_path):
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run import robot

    cfg = _cfg("robot", ["transport=inproc", "arm.kind=target", "safety.workspace_low=null", "safety.workspace_high=null", "episodes=2", "control.max_steps=40",
                         "inproc_server.inference_delay_s=0.05", f"store={tmp_path / 'eps'}"])
    rep = robot.run(cfg, RunContext(cfg, out_dir=tmp_path / "run"))
    assert rep["num_episodes"] == 2 and rep["recorded"] == [0, 1]
    store = EpisodeStore.open(tmp_path / "eps")
    assert len(store) == 2
    ep = store.episode(1)
    assert ep.length == 40 and ep.info["failure_label"] == "timeout" and ep.info["failure_source"] == "success_predicate"
    assert "cmd_latency_s" in ep.extras and "t_cmd" in ep.extras
    assert np.all(np.diff(ep.extras["t_cmd"]) > 0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wmrl(args, out, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "wmrl.cli", *args, f"hydra.run.dir={out}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _wait_line(proc, needle, timeout=60):
    t_end = time.monotonic() + timeout
    lines = []
    while time.monotonic() < t_end:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not printed within {timeout} s:\n{''.join(lines)}")


def test_server_killed_and_restarted_robot_reconnects_finishes_and_exits_nonzero(tmp_path):
    """kill -9 of `wmrl serve` mid-episode: the robot holds, the watchdog stops it (episode
    recorded as `watchdog`), it reconnects to the restarted server with backoff and runs the
    other episodes; its exit status (3) says an episode was lost."""
    from wmrl.kernel.storage import EpisodeStore

    port = _free_port()
    addr = f"transport.address=127.0.0.1:{port}"
    serve = ["serve", "transport=grpc", addr, "inference_delay_s=0.05", "accept_timeout_s=60"]
    server = _wmrl(serve, tmp_path / "srv")
    restarted = None
    try:
        _wait_line(server, "wmrl-serve ready")
        robot = _wmrl(["robot", "transport=grpc", addr, "arm.kind=target", "safety.workspace_low=null",
                       "safety.workspace_high=null", "episodes=3", "control.max_steps=40", "control.watchdog_s=0.4",
                       "reconnect.backoff_s=0.2", "reconnect.backoff_max_s=0.5", f"store={tmp_path / 'eps'}"],
                      tmp_path / "rob")
        _wait_line(robot, "connected to the policy server")
        time.sleep(1.0)
        server.send_signal(signal.SIGKILL)  # the policy server dies mid-episode
        server.wait(timeout=10)
        restarted = _wmrl(serve, tmp_path / "srv2")  # and is started again on the same port
        out, _ = robot.communicate(timeout=90)
    finally:
        for p in (server, restarted):
            if p is not None and p.poll() is None:
                p.kill()
    assert robot.returncode == 3, out
    assert "1 of 3 episodes did not run to completion (episodes [0])" in out
    rep = json.loads((tmp_path / "rob" / "report.json").read_text())
    rows = rep["episodes"]
    assert [r["failure_label"] == "watchdog" for r in rows] == [True, False, False], rows
    assert rows[0]["steps"] < 40 and rows[1]["steps"] == rows[2]["steps"] == 40
    assert rep["episodes_lost"] == [0] and len(rep["reconnects"]) == 1
    store = EpisodeStore.open(tmp_path / "eps")
    assert len(store) == 3
    ep = store.episode(0)
    assert ep.length == rows[0]["steps"] and not ep.success and ep.info["failure_label"] == "watchdog"
    assert ep.extras["starved"][-1] == 1.0  # holding when stopped


def test_boundary_jerk_counts_only_chunk_switches():
    from wmrl.run.bench_bridge import boundary_jerk

    a = np.zeros((10, 7), np.float32)
    a[5:, 0] = 1.0  # a step exactly at the boundary between chunk 1 and 2
    ids = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    # boundaries at steps 3 (first, excluded) and 5: |a6 - 2a5 + a4| = 1
    assert boundary_jerk(a, ids) == pytest.approx(1.0)
    assert boundary_jerk(np.zeros((10, 7)), ids) == 0.0


def test_bench_bridge_inproc_smoke(tmp_path):
    from wmrl.run import bench_bridge

    cfg = _cfg("bench_bridge", ["transports=[inproc]", "delays_s=[0.1]", "jerk_delay_s=0.1", "duration_s=2",
                                "settle_s=0.5", "image_size=[8,8]",
                                "process.nice=null"])   # in process: keep the test process's priority
    rep = bench_bridge.run(cfg, RunContext(cfg, out_dir=tmp_path))
    assert {r["merge"] for r in rep["runs"]} == {"latency_aware", "naive"}
    s = rep["summary"]["inproc"]
    assert s["jerk_ratio"] is not None and s["jerk"] < s["naive_jerk"]


def _tiny_flow_vla():
    from policies.flow_vla import FlowVLAPolicy
    from wmrl.kernel.storage import NormStats

    pol = FlowVLAPolicy(cameras=["agentview"], image_size=[16, 16], state_dim=9, action_dim=7, chunk_size=4,
                        encoder={"kind": "conv", "channels": [8, 16], "out_dim": 16}, lang_dim=16, proprio_dim=8,
                        cond_dim=32, head_width=32, head_depth=1, time_dim=16)
    rng = np.random.default_rng(0)
    return pol.set_norm_stats(NormStats.from_data({"proprio": rng.standard_normal((200, 9)),
                                                   "actions": np.clip(rng.standard_normal((200, 7)), -1, 1)})).eval()


def test_flow_vla_rtc_matches_its_sampler_and_freezes_the_prefix():
    """``FlowVLAPolicy.sample(prefix=, delay=)``: an empty prefix gives the chunk of the policy's own
    sampler (same flow, same convention, same noise); a prefix's first ``delay`` actions come back
    as they are; guidance weight 0 is plain RTC sampling; ``noise_scale=0`` is followed."""
    import torch

    from policies.samplers import EulerODESampler
    from wmrl.kernel.types import Obs

    pol = _tiny_flow_vla()
    assert pol.supports_rtc
    g = torch.Generator().manual_seed(0)
    obs = Obs({"agentview": torch.randint(0, 256, (1, 3, 16, 16), generator=g, dtype=torch.uint8)},
              torch.randn(1, 9, generator=g), ["lift the red cube"])

    def gen():
        return torch.Generator().manual_seed(5)

    ref = pol.sample(obs, generator=gen()).actions
    empty = pol.sample(obs, generator=gen(), prefix=torch.zeros(0, 7), delay=0).actions
    torch.testing.assert_close(empty, ref, atol=1e-5, rtol=1e-4)
    prefix = torch.full((3, 7), 0.5)
    guided = pol.sample(obs, generator=gen(), prefix=prefix, delay=2).actions
    torch.testing.assert_close(guided[0, :2], prefix[:2], atol=1e-5, rtol=1e-5)
    pol.rtc_beta = 0.0
    assert torch.equal(pol.sample(obs, generator=gen(), prefix=prefix, delay=0).actions, empty)
    pol.sampler = EulerODESampler(10, noise_scale=0.0)  # from the prior mean: RTC adds guidance, not noise
    a, b = (pol.sample(obs, generator=torch.Generator().manual_seed(i), prefix=torch.zeros(0, 7)).actions
            for i in (1, 2))
    assert torch.equal(a, b)
    torch.testing.assert_close(a, pol.sample(obs).actions, atol=1e-5, rtol=1e-4)


def test_serve_builds_the_policy_with_its_rtc_settings(tmp_path):
    from robot_bridge.testing import TrackingPolicy
    from wmrl.run.bridge import served_policy, make_server

    from omegaconf import OmegaConf

    cfg = _cfg("serve", ["rtc_beta=2.5"])
    cfg.policy = OmegaConf.create({"_target_": "policies.flow_vla.FlowVLAPolicy", "cameras": ["agentview"],
                                   "image_size": [16, 16], "chunk_size": 4, "head_width": 32, "head_depth": 1,
                                   "encoder": {"kind": "conv", "channels": [8], "out_dim": 16}})
    pol = served_policy(cfg, RunContext(cfg, out_dir=tmp_path))
    assert pol.rtc_beta == 2.5 and make_server(cfg, RunContext(cfg, out_dir=tmp_path)).supports_prefix
    cfg = _cfg("serve", ["rtc=false"])
    srv = make_server(cfg, RunContext(cfg, out_dir=tmp_path))
    assert isinstance(srv.policy, TrackingPolicy) and not srv.supports_prefix


def test_operator_estop_signal_stops_node_and_records_episode(tmp_path):
    from wmrl.kernel.storage import EpisodeStore

    port = _free_port()
    addr = f"transport.address=127.0.0.1:{port}"
    server = _wmrl(["serve", "transport=grpc", addr, "accept_timeout_s=60"], tmp_path / "srv")
    try:
        _wait_line(server, "wmrl-serve ready")
        robot = _wmrl(["robot", "transport=grpc", addr, "arm.kind=target", "safety.workspace_low=null", "safety.workspace_high=null", "episodes=3", "control.max_steps=400",
                       f"store={tmp_path / 'eps'}"], tmp_path / "rob")
        _wait_line(robot, "connected to the policy server")
        time.sleep(1.0)
        robot.send_signal(signal.SIGUSR1)  # operator e-stop
        out, _ = robot.communicate(timeout=60)
    finally:
        server.kill()
    assert robot.returncode == 3, out  # the e-stopped episode and the two never run are lost
    assert "3 of 3 episodes did not run to completion" in out
    rep = json.loads((tmp_path / "rob" / "report.json").read_text())
    assert rep["num_episodes"] == 1 and rep["episodes"][0]["failure_label"] == "estop"  # no further episode
    ep = EpisodeStore.open(tmp_path / "eps").episode(0)
    assert ep.info["failure_label"] == "estop" and ep.info["estop_reason"] == "operator signal"


BENCH_PARENT = """
import sys, time
from pathlib import Path
from wmrl.run.bench_bridge import _start_server_process
from wmrl.run.bridge import link_by_name
proc = _start_server_process(link_by_name("grpc").on_loopback(0), 0.0, {"chunk_size": 16}, Path(sys.argv[1]),
                             {"nice": None})
print(proc.pid, flush=True)
time.sleep(120)
"""


def test_bench_policy_server_dies_with_a_killed_benchmark(tmp_path):
    """`wmrl bench bridge` starts `wmrl serve` as a child (wmrl.kernel.workers.child_env): kill -9 of the
    benchmark leaves no policy server behind."""
    from test_workers import _alive  # tests/ is on sys.path (no __init__.py)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.Popen([sys.executable, "-c", BENCH_PARENT, str(tmp_path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        t0 = time.time()
        while _alive(pid) and time.time() - t0 < 5:
            time.sleep(0.1)
        assert not _alive(pid), "wmrl serve outlived the killed benchmark by 5 s"
    finally:
        parent.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_estop_signal_while_the_arm_holds_its_lock_does_not_deadlock():
    """SIGUSR1 can arrive while the main thread is inside ``observe``/``apply`` holding the arm's
    lock; the handler then runs in that same thread. It must set the e-stop at once and leave
    ``robot.stop()`` (which takes the lock) to another thread, not wait for a lock its own thread holds
    (that hung the node: the e-stop test above timed out on a loaded CI machine)."""
    import threading

    from robot_bridge.arm import _operator_signals
    from robot_bridge.client import RobotClient
    from robot_bridge.testing import KinematicArm

    arm = KinematicArm()
    client = RobotClient(arm, transport_factory=lambda: None)
    old = _operator_signals(client, lambda *_: None)
    rescue = threading.Timer(5.0, arm.lock.release)   # only if the handler blocks on the lock we hold
    try:
        arm.lock.acquire()   # the main thread is "inside apply()"
        rescue.start()
        os.kill(os.getpid(), signal.SIGUSR1)   # the handler runs in this thread, now
        assert client._estop.wait(2.0), "the e-stop was not set while the arm's lock was held"
        assert rescue.is_alive(), "the handler waited for the arm's lock held by its own thread"
        assert not arm.stopped   # stop() waits for the interrupted call to let go of the lock ...
        rescue.cancel()
        arm.lock.release()
        t0 = time.monotonic()
        while not arm.stopped and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert arm.stopped and client._estop_reason == "operator signal"   # ... then the arm stops
    finally:
        rescue.cancel()
        for sig, handler in old.items():
            signal.signal(sig, handler)
