"""Robot bridge: a trained chunking policy drives a (simulated or real) arm with asynchronous
action chunks, and every deployed episode comes back into the EpisodeStore.

Pieces (each module's docstring has the details):

* ``messages`` / ``proto/bridge.proto``: typed protobuf messages (observation with chunk request
  and real-time-chunking prefix, action chunk, hello/ready, heartbeat, e-stop, episode end, error),
  size limits and validation; malformed, oversized, wrong-dimension or non-finite / out-of-range
  messages (the real-time-chunking prefix included) are rejected with an ``Error`` reply while the
  link stays up. No pickle anywhere.
* ``queue``: actions keyed by control step; latency-aware merge (stale actions skipped, the
  newest observation wins).
* ``timing``: when the client requests the next chunk, from a robust estimate of the measured
  round trip (more than one request in flight when it exceeds what the queue covers), and the
  safe fallback (``hold`` / ``slow``) when no timing keeps up.
* real-time chunking is the policy's (``policies.rtc``, Black et al. 2025): the client sends the
  committed actions (``queue.ActionQueue.committed``) and the delay in steps, the server passes
  them to ``policy.sample(..., prefix=, delay=)`` when ``policy.supports_rtc``; no flow math here.
* ``safety``: command clipping (range, rate, workspace box) and the server watchdog.
* ``client``: :class:`RobotClient`, the fixed-rate control loop (requests when ``timing`` says,
  never blocks the tick on I/O, holds when dry, stops on e-stop or watchdog, records the episode
  with the fallback it decided); reopens the link with exponential backoff between episodes
  when the server went away. Its settings: ``client_config.ClientConfig``.
* ``server``: :class:`PolicyServer` (warm-up before ``Ready``, every request answered, inference
  off the receive thread, heartbeats, injectable inference delay as latency or as compute); one
  session per robot connection, up to ``max_sessions`` at once, ``[busy]`` beyond, ``[timeout]``
  for silent ones; ``plan``: a session's record of the chunks it computed, which a request sent
  while earlier ones are in flight continues (real-time chunking with overlapping requests).
* ``transports``: in-process, gRPC bidirectional stream, ROS 2 over Cyclone DDS (ROS topic and
  type names, byte layout equal to rosbags' CDR, loopback-only configuration for tests).
* ``arm``: :class:`ChunkEnvArm` (a one-slot ``ChunkEnv`` as the robot), the episode recorder and
  the node loop of ``wmrl robot``; ``testing``: mock arm and policies for tests and benchmarks.

Entry points (composition in ``wmrl/run``): ``wmrl serve``, ``wmrl robot``, ``wmrl bench bridge``,
``wmrl refine``. This package imports only ``wmrl`` core modules (types, interfaces), grpc,
protobuf and cyclonedds.

Compared with LeRobot 0.6.1 async inference, by construction:
no observation is dropped as "similar" (every request is answered), the server is warmed up
before the first request, observations are sent from a sender thread (not in the control tick),
only actions that are really stale are skipped (not always the first of a chunk), and protobuf
replaces pickle on the wire.
"""
