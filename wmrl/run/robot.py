"""``wmrl robot``: the MuJoCo arm node of the robot bridge.

    wmrl serve transport=grpc checkpoint=runs/bc/checkpoints/last &      # the policy server
    wmrl robot transport=grpc suite=tiny episodes=4 store=runs/deploy/episodes

Plays the robot in real time on a sim-suite task (``SimEnv`` with one slot, stepped one control
step per tick), streams observations to the policy server, executes its chunks through the
safety layer, and appends every episode (successes, failures, e-stops, watchdog stops) with
command timestamps, latencies, outcome and failure label to an EpisodeStore. ``arm.kind=target``
plays any ``RobotInterface`` given by ``arm.target._target_`` instead (e.g. the kinematic test arm).
See ``robot_bridge.client`` and ``robot_bridge.arm``.
"""

from __future__ import annotations

import logging
import threading

import hydra
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from robot_bridge.arm import ChunkEnvArm, EpisodeRecorder, run_node
from robot_bridge.client import ClientConfig
from robot_bridge.messages import Limits
from robot_bridge.safety import SafetyLimits
from wmrl.run.common import RunContext, run_main
from wmrl.types import PANDA_OSC_POSE, Obs

log = logging.getLogger("wmrl.robot")


def build_arm(cfg: DictConfig):
    """``(arm, action_space dict, embodiment)`` from ``cfg.arm`` (and ``cfg.suite`` for ``kind=sim``)."""
    kind = cfg.arm.kind
    if kind == "sim":
        suite = instantiate(cfg.suite)
        tasks = list(cfg.arm.tasks) if cfg.arm.get("tasks") else suite.task_names
        split = str(cfg.arm.get("split", "eval"))
        make = suite.eval_start if split == "eval" else suite.train_start

        def start(i: int):
            return make(tasks[i % len(tasks)], i // len(tasks))

        env = suite.make_env(num_envs=1, auto_reset=False)
        arm = ChunkEnvArm(env, start, cameras=suite.cameras, image_size=suite.image_size, state_dim=suite.state_dim)
        return arm, suite.action_space.to_dict(), "panda"
    if kind == "target":
        arm = instantiate(cfg.arm.target)
        return arm, PANDA_OSC_POSE.to_dict() if arm.action_dim == 7 else {"dim": arm.action_dim}, type(arm).__name__
    raise ValueError(f"arm.kind must be 'sim' or 'target', got {kind!r}")


def build_critic(cfg: DictConfig, ctx: RunContext):
    if not cfg.get("critic_checkpoint"):
        return None
    from wmrl.checkpoint import load_checkpoint

    critic = load_checkpoint(ctx.path(cfg.critic_checkpoint))
    critic.eval()

    def success_prob(proprio, images, task=""):
        obs = Obs({c: torch.from_numpy(np.ascontiguousarray(v))[None] for c, v in images.items()},
                  torch.from_numpy(proprio)[None], [task])
        with torch.no_grad():
            return float(critic.success_prob(obs)[0])

    return success_prob


def start_inproc_server(cfg: DictConfig, ctx: RunContext, limits_robot: Limits):
    """Policy server in a thread of this process, joined by an in-process transport."""
    from robot_bridge.transports.inproc import InProcTransport
    from wmrl.run.serve import make_server

    server = make_server(cfg.inproc_server, ctx)
    robot_end, server_end = InProcTransport.pair(limits_robot, server.limits)
    th = threading.Thread(target=server.serve, args=(server_end,), daemon=True, name="inproc-server")
    th.start()
    return robot_end, server


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from wmrl.storage import EpisodeStore

    from robot_bridge.process import tune_process

    tuned = tune_process(cfg.process.get("nice"), cfg.process.get("switch_interval_s"))
    arm, action_space, embodiment = build_arm(cfg)
    limits = Limits(action_dim=arm.action_dim)
    if cfg.transport.kind == "inproc":
        transport, _ = start_inproc_server(cfg, ctx, limits)
    elif cfg.transport.kind == "ros2":
        transport = instantiate(cfg.transport.robot, limits=limits, cameras=list(arm.cameras),
                                control_hz=float(cfg.control.control_hz))
    else:
        transport = instantiate(cfg.transport.robot, limits=limits)
    store_path = ctx.path(cfg.store) if cfg.get("store") else ctx.out_dir / "episodes"
    store = EpisodeStore.open_or_create(
        store_path, cameras={c: tuple(arm.image_size) for c in arm.cameras}, state_dim=arm.state_dim,
        action_dim=arm.action_dim, fps=float(cfg.control.control_hz), action_space=action_space,
        embodiment=embodiment, source="robot_bridge")
    client_cfg = ClientConfig(**OmegaConf.to_container(cfg.control, resolve=True))
    safety = SafetyLimits(**OmegaConf.to_container(cfg.safety, resolve=True))
    recorder = EpisodeRecorder(store)
    summary = run_node(arm, transport, int(cfg.episodes), client_cfg, safety=safety, recorder=recorder,
                       critic=build_critic(cfg, ctx))
    summary["store"] = str(store_path)
    summary["recorded"] = recorder.indices
    summary["transport"] = cfg.transport.kind
    summary["process"] = tuned
    for r in summary["episodes"]:
        log.info("episode %d %s: success=%s label=%r steps=%d starved=%d ttfa=%.3fs p99=%s ms", r["episode"],
                 r["task"], r["success"], r["failure_label"], r["steps"], r["starved_after_first"],
                 r["time_to_first_action_s"], r["latency_p99_ms"])
    return summary


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="robot")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "robot", errors=(ValueError, ConnectionError, TimeoutError))


if __name__ == "__main__":
    main()
