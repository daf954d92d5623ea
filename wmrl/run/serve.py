"""``wmrl serve``: the policy server of the robot bridge.

    wmrl serve checkpoint=runs/bc/checkpoints/last transport=grpc transport.address=127.0.0.1:50051
    wmrl serve transport=ros2 inference_delay_s=0.15          # test policy, 150 ms per chunk

Loads a policy (``checkpoint`` via ``wmrl.kernel.checkpoint.load_checkpoint``, or ``policy._target_``),
wraps a flow-matching policy for real-time chunking (:class:`FlowRTCAdapter`) and serves robot
connections (``wmrl robot``), up to ``max_sessions`` at once; one more is told ``[busy]``
(``on_busy=reject``) or waits (``on_busy=queue``); a connection that says no ``Hello`` within
``hello_timeout_s``, or nothing but heartbeats for ``idle_timeout_s``, is ended with
``[timeout]``. Prints ``wmrl-serve ready <address>`` once listening.
See ``robot_bridge.server.PolicyServer``.
"""

from __future__ import annotations

import logging
import sys

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from robot_bridge.messages import Limits
from robot_bridge.server import PolicyServer, SessionLimits
from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.serve")


class FlowRTCAdapter:
    """Exposes a ``policies.flow_vla.FlowVLAPolicy`` (pi0 flow convention: ``x_s = (1-s) a + s eps``,
    ``v = eps - a``, sampled from ``s = 1`` to ``0`` in normalised action space) to the bridge's
    real-time chunking (``robot_bridge.rtc``: ``t = 1 - s``, ``v_rtc(x, t) = -v(x, 1 - t)``).
    ``sample`` / ``log_prob`` are the policy's own."""

    def __init__(self, policy):
        self.policy = policy
        self.chunk_size = int(policy.chunk_size)
        self.action_dim = int(policy.action_dim)
        self.num_steps = int(getattr(policy.sampler, "num_steps", 10))

    def sample(self, obs, generator=None):
        return self.policy.sample(obs, generator)

    def log_prob(self, obs, sample):
        return self.policy.log_prob(obs, sample)

    def rtc_velocity_fn(self, obs):
        with torch.no_grad():  # encode the observation once, without a graph through the encoder
            vf = self.policy._velocity_fn(obs)
        return lambda x, t: -vf(x, 1.0 - t)

    def to_flow_space(self, actions: torch.Tensor) -> torch.Tensor:
        return self.policy.normalizer.normalize("actions", actions.float())

    def from_flow_space(self, x: torch.Tensor) -> torch.Tensor:
        from policies.action_space import clip_to_space

        return clip_to_space(self.policy.normalizer.unnormalize("actions", x), self.policy.action_space).float()


def build_policy(cfg: DictConfig, ctx: RunContext):
    """The served policy: ``cfg.checkpoint`` (a folder) or ``instantiate(cfg.policy)``; flow
    policies with a velocity field are wrapped in :class:`FlowRTCAdapter` when ``cfg.rtc``."""
    if cfg.get("checkpoint"):
        from wmrl.kernel.checkpoint import load_checkpoint

        path = ctx.path(cfg.checkpoint)
        if not path.is_dir():
            raise ValueError(f"checkpoint={cfg.checkpoint!r}: no checkpoint folder at {path}")
        policy = load_checkpoint(path, map_location=str(cfg.get("device", "cpu")))
    else:
        policy = instantiate(cfg.policy)
    if hasattr(policy, "eval"):
        policy.eval()
    for attr in ("chunk_size", "action_dim", "sample"):
        if not hasattr(policy, attr):
            raise ValueError(f"{type(policy).__name__} is not a wmrl Policy (no {attr!r})")
    if cfg.get("rtc", True) and hasattr(policy, "_velocity_fn") and hasattr(policy, "normalizer"):
        return FlowRTCAdapter(policy)
    return policy


def make_server(cfg: DictConfig, ctx: RunContext) -> PolicyServer:
    return PolicyServer(build_policy(cfg, ctx), inference_delay_s=float(cfg.get("inference_delay_s", 0.0)),
                        delay_jitter_s=float(cfg.get("delay_jitter_s", 0.0)),
                        heartbeat_s=float(cfg.get("heartbeat_s", 0.1)), seed=int(cfg.get("seed", 0)),
                        rtc=bool(cfg.get("rtc", True)), rtc_beta=float(cfg.get("rtc_beta", 5.0)),
                        limits=Limits(state_dim=cfg.get("state_dim"),
                                      max_message_bytes=int(cfg.get("max_message_bytes", 4 * 1024 * 1024))))


def session_limits(cfg: DictConfig) -> SessionLimits:
    """``max_sessions``, ``on_busy``, ``hello_timeout_s``, ``idle_timeout_s`` of ``cfg``."""
    def opt(key):
        v = cfg.get(key)
        return None if v is None else float(v)

    return SessionLimits(max_sessions=int(cfg.max_sessions), on_busy=str(cfg.on_busy),
                         hello_timeout_s=opt("hello_timeout_s"), idle_timeout_s=opt("idle_timeout_s"))


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    if cfg.transport.kind == "inproc":
        raise ValueError("transport=inproc runs the server inside `wmrl robot`; use transport=grpc or ros2")
    from robot_bridge.process import tune_process

    tuned = tune_process(cfg.process.get("nice"), cfg.process.get("switch_interval_s"))
    limits = session_limits(cfg)
    server = make_server(cfg, ctx)
    extra = {"max_streams": limits.max_sessions + 4} if cfg.transport.kind == "grpc" else {}  # room to say [busy]
    endpoint = instantiate(cfg.transport.server, limits=server.limits, **extra)
    address = getattr(endpoint, "address", f"ros2 domain {cfg.transport.get('domain_id')}")
    print(f"wmrl-serve ready {address}", flush=True)
    try:
        server.serve_endpoint(endpoint, limits, accept_timeout_s=float(cfg.accept_timeout_s),
                              max_connections=int(cfg.max_connections))
    except KeyboardInterrupt:
        log.info("interrupted")
    finally:
        server.stop()
        if hasattr(endpoint, "stop"):
            endpoint.stop(0)
        elif hasattr(endpoint, "close"):
            endpoint.close()
    inf = server.stats["inference_s"]
    return {"sessions": list(server.sessions), "address": address, "process": tuned,
            "busy_refused": server.stats["busy"], "sessions_timed_out": server.stats["timeouts"],
            "inference_s_mean": sum(inf) / len(inf) if inf else None, "inference_calls": len(inf)}


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="serve")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "serve")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
