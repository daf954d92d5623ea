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
    from wmrl.run import robot
    from wmrl.storage import EpisodeStore

    cfg = _cfg("robot", ["transport=inproc", "arm.kind=target", "episodes=2", "control.max_steps=40",
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


def test_server_killed_mid_episode_robot_stops_and_records_failure(tmp_path):
    from wmrl.storage import EpisodeStore

    port = _free_port()
    addr = f"transport.address=127.0.0.1:{port}"
    server = _wmrl(["serve", "transport=grpc", addr, "inference_delay_s=0.05", "accept_timeout_s=60"], tmp_path / "srv")
    try:
        _wait_line(server, "wmrl-serve ready")
        robot = _wmrl(["robot", "transport=grpc", addr, "arm.kind=target", "episodes=1", "control.max_steps=400",
                       "control.watchdog_s=0.4", f"store={tmp_path / 'eps'}"], tmp_path / "rob")
        _wait_line(robot, "connected to the policy server")
        time.sleep(2.0)
        server.send_signal(signal.SIGKILL)  # the policy server dies mid-episode
        out, _ = robot.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert robot.returncode == 0, out
    rep = json.loads((tmp_path / "rob" / "report.json").read_text())
    row = rep["episodes"][0]
    assert row["failure_label"] == "watchdog" and not row["success"] and row["steps"] < 400
    store = EpisodeStore.open(tmp_path / "eps")
    assert len(store) == 1
    ep = store.episode(0)
    assert ep.length == row["steps"] and not ep.success and ep.info["failure_label"] == "watchdog"
    assert ep.extras["starved"][-1] == 1.0  # holding when stopped
