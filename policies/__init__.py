"""Policies: the flow-matching VLA (``policies.flow_vla``), samplers with exact log-probs
(``policies.samplers``), BC training (``policies.train``), action-space conventions
(``policies.action_space``) and LeRobot policy adapters (``policies.lerobot_adapters``).
Submodules are imported on demand (the sentence encoder and LeRobot are heavy)."""
