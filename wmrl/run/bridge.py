"""Composition of the robot bridge shared by ``wmrl serve``, ``wmrl robot`` and ``wmrl bench bridge``
(not an entry point): the served policy, the policy server, its session limits, the transport
link of ``configs/transport/<name>.yaml`` (Hydra ``_target_``, a
``robot_bridge.transports.base.TransportLink``) and the in-process server of ``transport=inproc``.
"""

from __future__ import annotations

import threading

from hydra.utils import instantiate
from omegaconf import DictConfig

from robot_bridge.messages import Limits
from robot_bridge.server import PolicyServer, SessionLimits
from robot_bridge.transports.base import TransportLink
from wmrl.run.common import RunContext

POLICY_MEMBERS = ("chunk_size", "action_dim", "sample", "supports_rtc")  # of wmrl.kernel.interfaces.Policy


def served_policy(cfg: DictConfig, ctx: RunContext):
    """The served policy: ``cfg.checkpoint`` (a folder) or ``instantiate(cfg.policy)``, in eval
    mode; a policy with ``supports_rtc`` gets ``rtc_beta = cfg.rtc_beta`` (its RTC guidance cap).

    Raises ``ValueError`` for a missing checkpoint folder or an object that is not a Policy."""
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
    for attr in POLICY_MEMBERS:
        if not hasattr(policy, attr):
            raise ValueError(f"{type(policy).__name__} is not a wmrl Policy (no {attr!r})")
    if policy.supports_rtc and cfg.get("rtc_beta") is not None:
        policy.rtc_beta = float(cfg.rtc_beta)
    return policy


def make_server(cfg: DictConfig, ctx: RunContext) -> PolicyServer:
    """A :class:`robot_bridge.server.PolicyServer` for the policy of ``cfg`` (``serve.yaml`` keys)."""
    return PolicyServer(served_policy(cfg, ctx), inference_delay_s=float(cfg.get("inference_delay_s", 0.0)),
                        delay_jitter_s=float(cfg.get("delay_jitter_s", 0.0)),
                        delay_mode=str(cfg.get("delay_mode", "latency")),
                        heartbeat_s=float(cfg.get("heartbeat_s", 0.1)), seed=int(cfg.get("seed", 0)),
                        rtc=bool(cfg.get("rtc", True)),
                        limits=Limits(state_dim=cfg.get("state_dim"),
                                      max_message_bytes=int(cfg.get("max_message_bytes", 4 * 1024 * 1024))))


def session_limits(cfg: DictConfig) -> SessionLimits:
    """``max_sessions``, ``on_busy``, ``hello_timeout_s``, ``idle_timeout_s`` of ``cfg``."""
    def opt(key):
        v = cfg.get(key)
        return None if v is None else float(v)

    return SessionLimits(max_sessions=int(cfg.max_sessions), on_busy=str(cfg.on_busy),
                         hello_timeout_s=opt("hello_timeout_s"), idle_timeout_s=opt("idle_timeout_s"))


def make_link(transport_cfg: DictConfig) -> TransportLink:
    """The link of a ``configs/transport/*.yaml`` node (its ``_target_``)."""
    link = instantiate(transport_cfg)
    if not isinstance(link, TransportLink):
        raise ValueError(f"transport._target_ must build a robot_bridge.transports.base.TransportLink, "
                         f"got {type(link).__name__}")
    return link


def link_by_name(name: str) -> TransportLink:
    """The link of ``configs/transport/<name>.yaml``, found on Hydra's config search path (that of
    the running app, or the ``configs`` package outside one)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return make_link(compose(config_name=f"transport/{name}").transport)
    with initialize_config_module(config_module="configs", version_base="1.3"):
        return make_link(compose(config_name=f"transport/{name}").transport)


def serve_in_process(server: PolicyServer, link: TransportLink) -> threading.Thread:
    """Serve ``link``'s server endpoint from a daemon thread of this process (one robot at a time,
    no hello / idle timeouts, as a robot's own server): ``transport=inproc``."""
    endpoint = link.server(server.limits, max_sessions=1)
    limits = SessionLimits(max_sessions=1, on_busy="queue", hello_timeout_s=None, idle_timeout_s=None)
    th = threading.Thread(target=server.serve_endpoint, args=(endpoint, limits), daemon=True, name="inproc-server")
    th.start()
    return th
