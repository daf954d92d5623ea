"""Policy server: answers every chunk request of a robot client with an action chunk.

Differences from LeRobot 0.6.1 async inference (measured failings listed in DESIGN.md), by design:
every request is answered (no observation is dropped as "too similar"); the policy is warmed up
(one dummy inference of the robot's shapes) before ``Ready`` is sent, so the first real request
is not cold; inference runs in a worker thread so the connection keeps receiving, heart-beating
and rejecting bad messages while the policy thinks; the first action of a chunk is not dropped
(the client skips exactly the actions that are stale, see ``robot_bridge.queue``); protobuf only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import numpy as np
import torch

from robot_bridge import messages as M
from robot_bridge.rtc import rtc_sample
from wmrl.types import Obs

log = logging.getLogger("robot_bridge.server")

Envelope = M.Envelope


def obs_from_message(o: M.pb.Observation) -> Obs:
    """Batch-1 ``wmrl.types.Obs`` from an observation message."""
    proprio, images, _ = M.observation_arrays(o)
    return Obs(images={k: torch.from_numpy(np.ascontiguousarray(v))[None] for k, v in images.items()},
               proprio=torch.from_numpy(proprio)[None], task=[o.task])


class PolicyServer:
    """Serves a chunking policy over one transport connection at a time.

    Args:
        policy: ``wmrl.interfaces.Policy`` (``sample(Obs) -> PolicySample`` with actions
            ``(1, H, D_a)``). Real-time chunking is used for requests carrying a prefix when the
            policy also implements :class:`robot_bridge.rtc.RTCFlowPolicy` (``rtc_velocity_fn``,
            ``to_flow_space``, ``from_flow_space``, ``num_steps``); the composition root wraps a
            flow policy in such an adapter.
        inference_delay_s: pads each inference to at least this long (benchmarks: simulate a
            large policy); 0 = off.
        delay_jitter_s: uniform extra delay in ``[0, delay_jitter_s]``.
        heartbeat_s: period of ``Heartbeat`` messages (the client's watchdog listens to them).
        limits: what is accepted from the robot (``action_dim`` is set from the policy).
        seed: generator seed for sampling.
    """

    def __init__(self, policy: Any, *, inference_delay_s: float = 0.0, delay_jitter_s: float = 0.0,
                 heartbeat_s: float = 0.1, limits: M.Limits | None = None, seed: int = 0, rtc: bool = True,
                 rtc_beta: float = 5.0):
        self.policy = policy
        self.action_dim = int(policy.action_dim)
        self.chunk_size = int(policy.chunk_size)
        self.inference_delay_s = float(inference_delay_s)
        self.delay_jitter_s = float(delay_jitter_s)
        self.heartbeat_s = float(heartbeat_s)
        lim = limits or M.Limits()
        self.limits = M.Limits(**{**lim.__dict__, "action_dim": self.action_dim})
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.supports_prefix = bool(rtc) and hasattr(policy, "rtc_velocity_fn")
        self.rtc_beta = rtc_beta
        self.stats = {"requests": 0, "chunks": 0, "errors_sent": 0, "rejected": 0, "inference_s": []}
        self._stop = threading.Event()
        self.last_inference_s = 0.0

    # ------------------------------------------------------------------ inference
    def infer(self, o: M.pb.Observation) -> np.ndarray:
        """Actions ``float32 (H, D_a)`` for one observation message (padded to the injected delay)."""
        obs = obs_from_message(o)
        _, _, prefix = M.observation_arrays(o)
        t0 = time.perf_counter()  # inference = the policy call (padded to the injected delay)
        if self.supports_prefix and prefix is not None:
            actions = self._rtc(obs, prefix, int(o.delay_steps))  # needs autograd for the guidance
        else:
            with torch.no_grad():
                actions = self.policy.sample(obs, generator=self.generator).actions
        target = self.inference_delay_s + (self.rng.uniform(0, self.delay_jitter_s) if self.delay_jitter_s else 0.0)
        rest = target - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        self.last_inference_s = time.perf_counter() - t0
        a = actions.detach().to(torch.float32).cpu().numpy()
        if a.ndim != 3 or a.shape[0] != 1 or a.shape[2] != self.action_dim:
            raise RuntimeError(f"policy returned actions of shape {a.shape}, expected (1, H, {self.action_dim})")
        return a[0]

    def _rtc(self, obs: Obs, prefix: np.ndarray, delay: int) -> torch.Tensor:
        pol = self.policy
        y = pol.to_flow_space(torch.from_numpy(prefix))
        # the same sampling temperature as the policy's own sampler (e.g. noise_scale=0: from the prior
        # mean, as the VLA is evaluated); RTC then only adds the prefix guidance
        scale = float(getattr(getattr(pol, "sampler", None), "noise_scale", 1.0))
        noise = torch.randn(1, self.chunk_size, self.action_dim, generator=self.generator) * scale
        x = rtc_sample(pol.rtc_velocity_fn(obs), noise, y, delay, num_steps=int(getattr(pol, "num_steps", 10)),
                       beta=self.rtc_beta)
        return pol.from_flow_space(x)

    def warmup(self, hello: M.pb.Hello) -> float:
        """One dummy inference with the robot's shapes (zeros), not padded by the delay."""
        t0 = time.perf_counter()
        h = hello.image_height or 64
        w = hello.image_width or 64
        obs = Obs(images={c: torch.zeros(1, 3, h, w, dtype=torch.uint8) for c in hello.cameras},
                  proprio=torch.zeros(1, max(1, hello.state_dim)), task=[hello.task])
        with torch.no_grad():
            self.policy.sample(obs, generator=torch.Generator().manual_seed(0))
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ serving
    def stop(self) -> None:
        self._stop.set()

    def serve(self, transport, idle_timeout_s: float | None = None) -> dict:
        """Serve one connection until the peer disconnects, ``stop()`` is called or nothing was
        received for ``idle_timeout_s``. Returns ``self.stats``."""
        work: queue.Queue = queue.Queue()
        done = threading.Event()
        send_lock = threading.Lock()

        def send(env):
            with send_lock:
                transport.send(env)

        def worker():
            while not done.is_set():
                try:
                    o = work.get(timeout=0.05)
                except queue.Empty:
                    continue
                try:
                    a = self.infer(o)
                    dt = self.last_inference_s
                    self.stats["inference_s"].append(dt)
                    send(M.make_chunk(actions=a, start_step=o.step, episode=o.episode, obs_stamp_ns=o.stamp_ns,
                                      inference_s=dt, request_id=o.request_id))
                    self.stats["chunks"] += 1
                except (ConnectionError, OSError):
                    done.set()
                except Exception as e:  # policy failure: report it, keep serving
                    log.exception("inference failed")
                    try:
                        send(M.make_error("internal", f"inference failed: {e}", o.request_id))
                    except Exception:
                        done.set()

        def heartbeat():
            while not done.wait(self.heartbeat_s):
                try:
                    send(Envelope(heartbeat=M.pb.Heartbeat(stamp_ns=M.now_ns())))
                except Exception:
                    done.set()

        threads = [threading.Thread(target=worker, daemon=True, name="server-worker"),
                   threading.Thread(target=heartbeat, daemon=True, name="server-heartbeat")]
        for t in threads:
            t.start()
        last = time.monotonic()
        try:
            while not (done.is_set() or self._stop.is_set()):
                try:
                    env = transport.recv(timeout=0.05)
                except M.MessageError as e:
                    self.stats["rejected"] += 1
                    log.warning("rejected message: %s", e)
                    send(M.make_error(e))
                    self.stats["errors_sent"] += 1
                    continue
                except ConnectionError:
                    break
                if env is None:
                    if idle_timeout_s is not None and time.monotonic() - last > idle_timeout_s:
                        break
                    continue
                last = time.monotonic()
                k = M.kind(env)
                if k == "hello":
                    hl = env.hello
                    if hl.action_dim and hl.action_dim != self.action_dim:
                        send(M.make_error("invalid", f"robot takes D_a={hl.action_dim} but the policy outputs "
                                          f"D_a={self.action_dim}; serve a policy for this robot"))
                        self.stats["errors_sent"] += 1
                        continue
                    wu = self.warmup(hl)
                    send(Envelope(ready=M.pb.Ready(action_dim=self.action_dim, chunk_size=self.chunk_size,
                                                   supports_prefix=self.supports_prefix, warmup_s=wu)))
                elif k == "observation":
                    if env.observation.request:
                        self.stats["requests"] += 1
                        work.put(env.observation)
                elif k == "estop":
                    log.warning("robot reported e-stop: %s", env.estop.reason)
                elif k in ("heartbeat", "episode_end", "error"):
                    if k == "error":
                        log.warning("robot reported error: %s", env.error.message)
                else:
                    send(M.make_error("invalid", f"a policy server does not accept {k!r} messages"))
                    self.stats["errors_sent"] += 1
        finally:
            done.set()
            for t in threads:
                t.join(timeout=1.0)
        return self.stats

    def send_estop(self, transport, reason: str = "operator") -> None:
        transport.send(Envelope(estop=M.pb.EStop(reason=reason)))

