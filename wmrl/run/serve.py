"""``wmrl serve``: the policy server of the robot bridge.

    wmrl serve checkpoint=runs/bc/checkpoints/last transport=grpc transport.address=127.0.0.1:50051
    wmrl serve transport=ros2 inference_delay_s=0.15          # test policy, 150 ms per chunk

Loads a policy (``checkpoint`` via ``wmrl.kernel.checkpoint.load_checkpoint``, or ``policy._target_``;
see ``wmrl.run.bridge``), answers requests carrying a committed prefix with the policy's own
real-time chunking when it ``supports_rtc`` (``rtc``, ``rtc_beta``), and serves robot
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
from omegaconf import DictConfig

from wmrl.run.bridge import make_link, make_server, session_limits
from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.serve")


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    link = make_link(cfg.transport)
    if link.same_process:
        raise ValueError(f"transport={link.name} runs the server inside `wmrl robot`; use transport=grpc or ros2")
    from robot_bridge.process import tune_process

    tuned = tune_process(cfg.process.get("nice"), cfg.process.get("switch_interval_s"))
    limits = session_limits(cfg)
    server = make_server(cfg, ctx)
    endpoint = link.server(server.limits, max_sessions=limits.max_sessions)
    address = endpoint.address
    print(f"wmrl-serve ready {address}", flush=True)
    try:
        server.serve_endpoint(endpoint, limits, accept_timeout_s=float(cfg.accept_timeout_s),
                              max_connections=int(cfg.max_connections))
    except KeyboardInterrupt:
        log.info("interrupted")
    finally:
        server.stop()
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
