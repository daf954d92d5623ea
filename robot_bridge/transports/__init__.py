"""Transports behind :class:`wmrl.kernel.interfaces.Transport`: in-process, gRPC, ROS 2 (Cyclone DDS)."""
