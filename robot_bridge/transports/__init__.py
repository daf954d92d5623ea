"""Transports behind :class:`wmrl.interfaces.Transport`: in-process, gRPC, ROS 2 (Cyclone DDS)."""
