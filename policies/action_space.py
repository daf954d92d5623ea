"""Action-space conventions, declared once per embodiment and applied in one place.

A policy outputs actions in the action space of the data it was trained on (declared by the
``EpisodeStore`` metadata, ``store.meta["action_space"]``, a :class:`wmrl.kernel.types.ActionSpace`).
An environment takes actions in its own declared space. Everything that differs between the two
(gripper sign and range, and the declared clipping range) is converted here, by
:class:`ActionConverter`, and nowhere else. Differences that cannot be converted without the robot
state (``delta`` vs ``absolute`` control, rotation representation, frame, controller) raise a
``ValueError`` that names the differing field: such data must be converted when it is imported,
never silently at run time.

Conventions (see ``wmrl.kernel.types``): the gripper command is the **last** action dimension; its two
declared values are ``gripper_open`` and ``gripper_close`` (robosuite: ``-1`` open, ``+1`` close).
"""

from __future__ import annotations

import torch

from wmrl.kernel.types import PANDA_EE_YAW, PANDA_OSC_POSE, ActionSpace

#: The action spaces of the embodiments this project knows, declared once.
#: ``panda``: robosuite Panda with ``OSC_POSE`` delta control (xyz and axis-angle deltas scaled to
#: [-1, 1] in the base frame, gripper -1 open / +1 close).
#: ``panda_ee``: the same arm with absolute end-effector targets and yaw (``sim.control.EeTargetControl``).
EMBODIMENTS: dict[str, ActionSpace] = {
    "panda": PANDA_OSC_POSE,
    "panda_ee": PANDA_EE_YAW,
}


def action_space_for(embodiment: str) -> ActionSpace:
    """The declared action space of ``embodiment``; raises ``KeyError`` listing the known ones."""
    try:
        return EMBODIMENTS[embodiment]
    except KeyError:
        raise KeyError(f"unknown embodiment {embodiment!r}; declared ones: {sorted(EMBODIMENTS)} "
                       "(add it to policies.action_space.EMBODIMENTS)") from None


def as_action_space(space: ActionSpace | dict | str | None) -> ActionSpace:
    """Accept an ``ActionSpace``, its ``to_dict()`` form, an embodiment name, or ``None`` (panda)."""
    if space is None:
        return PANDA_OSC_POSE
    if isinstance(space, ActionSpace):
        return space
    if isinstance(space, str):
        return action_space_for(space)
    if hasattr(space, "items"):
        return ActionSpace.from_dict(dict(space))
    raise TypeError(f"action_space must be an ActionSpace, a dict or an embodiment name, got {type(space)}")


def clip_to_space(actions: torch.Tensor, space: ActionSpace) -> torch.Tensor:
    """Clip ``actions`` ``(..., D_a)`` to the declared range ``[space.low, space.high]``."""
    if actions.shape[-1] != space.dim:
        raise ValueError(f"actions have D_a={actions.shape[-1]} but the action space declares dim={space.dim}")
    if isinstance(space.low, tuple) or isinstance(space.high, tuple):
        low, high = space.bounds()
        return torch.minimum(torch.maximum(actions, actions.new_tensor(low)), actions.new_tensor(high))
    return actions.clamp(min=space.low, max=space.high)


class ActionConverter:
    """Convert action chunks from a source action space (the policy's) to a target one (the env's).

    Args:
        src: the space the actions are expressed in.
        dst: the space the consumer expects.

    Raises:
        ValueError: if ``dim``, ``controller``, ``mode``, ``frame`` or ``rotation`` differ (naming the
            field and both values), or if a gripper open/close pair is degenerate.

    Calling it on ``float32 (..., D_a)`` maps the gripper dimension affinely so that ``src``'s open
    value becomes ``dst``'s open value and close becomes close, then clips to ``dst``'s range.
    """

    _MUST_MATCH = ("dim", "controller", "mode", "frame", "rotation")

    def __init__(self, src: ActionSpace | dict | str | None, dst: ActionSpace | dict | str | None):
        self.src, self.dst = as_action_space(src), as_action_space(dst)
        for name in self._MUST_MATCH:
            a, b = getattr(self.src, name), getattr(self.dst, name)
            if a != b:
                raise ValueError(
                    f"action spaces differ in {name!r}: policy/data has {a!r}, consumer expects {b!r}; "
                    "this cannot be converted at run time: re-import the data in the consumer's "
                    "action space or train the policy on it")
        if self.src.gripper_open == self.src.gripper_close or self.dst.gripper_open == self.dst.gripper_close:
            raise ValueError("gripper_open and gripper_close must differ in both action spaces")
        self._scale = (self.dst.gripper_close - self.dst.gripper_open) / (self.src.gripper_close - self.src.gripper_open)
        self._shift = self.dst.gripper_open - self._scale * self.src.gripper_open

    @property
    def is_identity(self) -> bool:
        return self._scale == 1.0 and self._shift == 0.0 and (self.src.low, self.src.high) == (self.dst.low, self.dst.high)

    def __call__(self, actions: torch.Tensor) -> torch.Tensor:
        if actions.shape[-1] != self.src.dim:
            raise ValueError(f"actions have D_a={actions.shape[-1]}, the source action space declares {self.src.dim}")
        if self._scale != 1.0 or self._shift != 0.0:
            actions = actions.clone()
            actions[..., -1] = actions[..., -1] * self._scale + self._shift
        return clip_to_space(actions, self.dst)
