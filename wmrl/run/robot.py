"""``wmrl robot``: the MuJoCo arm node of the robot bridge.

    wmrl serve transport=grpc checkpoint=runs/bc/checkpoints/last &      # the policy server
    wmrl robot transport=grpc suite=tiny episodes=4 store=runs/deploy/episodes

Plays the robot in real time on a sim-suite task (``SimEnv`` with one slot, stepped one control
step per tick), streams observations to the policy server, executes its chunks through the
safety layer, and appends every episode (successes, failures, e-stops, watchdog stops) with
command timestamps, latencies, outcome and failure label to an EpisodeStore. ``arm.kind=target``
plays any ``RobotInterface`` given by ``arm.target._target_`` instead (e.g. the kinematic test arm).
See ``robot_bridge.client`` and ``robot_bridge.arm``.

A policy server that cannot be reached (``transport.connect_timeout_s``), or that went away, is
retried with exponential backoff per ``reconnect`` (each failed try one log line naming the
address); an episode cut short by the server's death is recorded as ``watchdog`` and the
remaining episodes run once the server is back.

Exit status: 0 when every episode ran to completion (success or task failure, see
``robot_bridge.client.episode_ran``); 1 when the node could not start (e.g. no policy server:
one line on stderr); 3 when an episode was lost (watchdog, e-stop, interruption, or not run
because the server did not come back); the report is written in both of the latter cases.
"""

from __future__ import annotations

import logging
import sys

import hydra
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from robot_bridge.arm import ChunkEnvArm, EpisodeRecorder, run_node
from robot_bridge.client import ClientConfig, ReconnectPolicy, with_retry
from robot_bridge.messages import Limits
from robot_bridge.safety import SafetyLimits
from robot_bridge.transports.base import TransportLink
from wmrl.kernel.types import PANDA_OSC_POSE, Obs
from wmrl.run.bridge import make_link, make_server, serve_in_process
from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.robot")


def build_arm(cfg: DictConfig):
    """``(arm, action_space dict, embodiment)`` from ``cfg.arm`` (and ``cfg.suite`` for ``kind=sim``).

    ``kind=env``: ``arm.env`` builds a one-slot ``ChunkEnv`` with ``cameras``, ``image_size``,
    ``state_dim`` and ``action_space`` attributes, ``arm.starts`` the ``Start`` of each episode
    (``configs/robot_libero.yaml``: a LIBERO task played through ``sim.libero.env.LiberoChunkEnv``).
    """
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
    if kind == "env":  # any one-slot ChunkEnv from `arm.env._target_` (e.g. sim.libero.env.LiberoChunkEnv)
        env = instantiate(cfg.arm.env)
        starts = instantiate(cfg.arm.starts)  # a Sequence[Start] or a callable i -> Start
        arm = ChunkEnvArm(env, starts, cameras=env.cameras, image_size=env.image_size, state_dim=env.state_dim)
        return arm, env.action_space.to_dict(), str(cfg.arm.get("embodiment") or "panda")
    if kind == "target":
        arm = instantiate(cfg.arm.target)
        return arm, PANDA_OSC_POSE.to_dict() if arm.action_dim == 7 else {"dim": arm.action_dim}, type(arm).__name__
    raise ValueError(f"arm.kind must be 'sim', 'env' or 'target', got {kind!r}")


def build_critic(cfg: DictConfig, ctx: RunContext):
    if not cfg.get("critic_checkpoint"):
        return None
    from wmrl.kernel.checkpoint import load_checkpoint

    critic = load_checkpoint(ctx.path(cfg.critic_checkpoint))
    critic.eval()

    def success_prob(proprio, images, task=""):
        obs = Obs({c: torch.from_numpy(np.ascontiguousarray(v))[None] for c, v in images.items()},
                  torch.from_numpy(proprio)[None], [task])
        with torch.no_grad():
            return float(critic.success_prob(obs)[0])

    return success_prob


def transport_factory(link: TransportLink, arm, limits: Limits, control_hz: float):
    """``() -> transport`` opening a new link to the policy server of ``link``; its
    ``ConnectionError`` names the address tried and the setting to change (``link.start_hint()``).

    The first try waits ``link.connect_timeout_s`` (a missing server is reported at once);
    each further try after a failed one waits twice as long, up to 4x (a slow network still gets
    through); a try that reaches the server resets it.
    """
    base_s = float(link.connect_timeout_s)
    failed = [0]

    def open_link():
        try:
            t = link.robot(limits, cameras=list(arm.cameras), control_hz=control_hz,
                           connect_timeout_s=base_s * 2 ** min(failed[0], 2))
        except ConnectionError as e:
            failed[0] += 1
            raise ConnectionError(f"{e}; {link.start_hint()}") from None
        failed[0] = 0
        return t

    return open_link


def reconnect_policy(cfg: DictConfig) -> ReconnectPolicy:
    r = cfg.reconnect
    return ReconnectPolicy(attempts=int(r.attempts), backoff_s=float(r.backoff_s), backoff_max_s=float(r.backoff_max_s),
                           give_up_after_s=None if r.give_up_after_s is None else float(r.give_up_after_s))


def safety_limits(node, action_space: dict) -> SafetyLimits:
    """``SafetyLimits`` from ``safety.*``: a null ``low`` / ``high`` is the action space's declared
    range, and the workspace check reads the translation as the action space does (``mode``:
    delta OSC_POSE steps or absolute targets)."""
    from wmrl.kernel.types import ActionSpace

    space = ActionSpace.from_dict(action_space)
    s = OmegaConf.to_container(node, resolve=True)
    lo, hi = space.bounds()
    s["low"] = lo.tolist() if s.get("low") is None else s["low"]
    s["high"] = hi.tolist() if s.get("high") is None else s["high"]
    s["mode"] = space.mode
    return SafetyLimits(**s)


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from robot_bridge.process import tune_process
    from wmrl.kernel.storage import EpisodeStore

    tuned = tune_process(cfg.process.get("nice"), cfg.process.get("switch_interval_s"))
    arm, action_space, embodiment = build_arm(cfg)
    limits = Limits(action_dim=arm.action_dim)
    client_cfg = ClientConfig(**OmegaConf.to_container(cfg.control, resolve=True))
    safety = safety_limits(cfg.safety, action_space)
    critic = build_critic(cfg, ctx)
    link, reconnect = make_link(cfg.transport), reconnect_policy(cfg)
    factory = transport_factory(link, arm, limits, float(cfg.control.control_hz))
    if link.same_process:  # the policy server runs in a thread of this process; no reconnection
        serve_in_process(make_server(cfg.inproc_server, ctx), link)
        transport, factory = factory(), None
    else:  # reach the server before the store is created (a missing one leaves nothing behind)
        transport = with_retry(factory, reconnect)
    store_path = ctx.path(cfg.store) if cfg.get("store") else ctx.out_dir / "episodes"
    try:
        store = EpisodeStore.open_or_create(
            store_path, cameras={c: tuple(arm.image_size) for c in arm.cameras}, state_dim=arm.state_dim,
            action_dim=arm.action_dim, fps=float(cfg.control.control_hz), action_space=action_space,
            embodiment=embodiment, source="robot_bridge")
    except BaseException:
        transport.close()
        raise
    recorder = EpisodeRecorder(store)
    summary = run_node(arm, transport, int(cfg.episodes), client_cfg, safety=safety, recorder=recorder,
                       critic=critic, transport_factory=factory, reconnect=reconnect)
    summary["store"] = str(store_path)
    summary["recorded"] = recorder.indices
    summary["transport"] = link.name
    summary["process"] = tuned
    for r in summary["episodes"]:
        log.info("episode %d %s: success=%s label=%r steps=%d starved=%d ttfa=%.3fs p99=%s ms fallback=%s", r["episode"],
                 r["task"], r["success"], r["failure_label"], r["steps"], r["starved_after_first"],
                 r["time_to_first_action_s"], r["latency_p99_ms"], r["fallback"] or "-")
    return summary


EXIT_EPISODES_LOST = 3


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="robot")
def main(cfg: DictConfig) -> None:
    report = run_main(cfg, run, "robot", errors=(ValueError, ConnectionError, TimeoutError))
    lost = report["episodes_lost"]
    if lost:
        why = f"; the policy server did not come back: {report['gave_up']}" if report["gave_up"] else ""
        print(f"wmrl robot: {len(lost)} of {report['episodes_planned']} episodes did not run to completion "
              f"(episodes {lost}){why}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_EPISODES_LOST)


if __name__ == "__main__":
    main()
