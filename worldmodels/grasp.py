"""The finger-gap head: the finger joints at the end of a chunk, read from the wrist view at its start.

Whether the fingers stop on a cube or close on nothing is what the proprio dynamics
(``worldmodels.dynamics.ProprioDynamics``) cannot know from the arm alone; the wrist camera sees the
cube between the fingers. This head corrects the dynamics' predicted finger joints after the chunk::

    g_end = g_dyn + 0.01 m * MLP(CNN(wrist frame at the chunk's start), g_0 / 4 cm,
                                 the chunk's gripper commands, (p_dyn - p_0) / 5 cm, g_dyn / 4 cm
                                 [, CNN_a(anchor frame), (p_0 - c) / 10 cm, (p_dyn - c) / 10 cm])

with ``g`` the two finger joints (proprio dims 7, 8; m), ``p`` the end-effector position, ``_dyn`` the
dynamics' ensemble-mean prediction after the chunk and ``_0`` the state at its start. The output layer
starts at zero, so an untrained head is exactly the dynamics. The CNN sees the full-resolution wrist
frame (four stride-2 convolutions), not a pooled map; the MLP input is dropped out, and training
shifts and blurs the frames (``worldmodels.train``), since in imagination every chunk after the first
starts from an imagined (blurrier) frame.

Measured on the ee pipeline's data (docs/measurements.md, "Finger gap"): over held-out chunks that
close the gripper, the dynamics alone are 0.56 cm off the real finger gap after the chunk.

With ``anchor=True`` the head also sees the *anchor*: a real frame of the rollout's start (WoVR keeps
the real first frame as conditioning for the whole rollout), from another camera (agentview), with
the end effector's absolute position (``c`` = (0.5, 0, 0.1) m, the table's middle). Objects stay
where they are until grasped, so the real start frame and a faithful arm tell whether the fingers are
around a cube even when the imagined wrist frame is wrong; on the same held-out closing chunks rolled
4 chunks ahead, the head fed imagined wrist frames told only 62 % of the misses (fingers closing on
nothing), fed real ones 97 % (docs/measurements.md).

With ``wrist=False`` the head drops the first term (the wrist frame at the chunk's start) and reads
only the anchor and the arm. Inside an imagined rollout the policy closes the gripper where the
*imagined* wrist frame shows a cube between the fingers; a head reading that same frame agrees with
it, so a close on nothing that looks like a grasp in imagination is read as a hold.
"""

from __future__ import annotations

import torch
from torch import nn

from worldmodels.dynamics import GRIP_UNIT, POS_UNIT

FINGERS = slice(7, 9)   # the finger joints in the 9-D proprio layout (wmrl.kernel.types)
TABLE_CENTRE_M = (0.5, 0.0, 0.1)   # the anchor head's origin for the end-effector position (robot base frame)


class GraspHead(nn.Module):
    """See the module docstring.

    Args:
        chunk_size: ``H`` control steps per chunk.
        image_size: ``(Hi, Wi)`` of the camera; both divisible by 16.
        gripper_dim: the action dim of the gripper command (``-1``: the last, as in every action
            space of this project).
        channels: widths of the four stride-2 convolutions.
        hidden: MLP width. dropout: on the MLP's input (features and conditioning).
        anchor: also read an anchor frame (a second CNN) and the absolute end-effector position.
        wrist: read the camera's frame at the chunk's start (``False``: an anchor head that does
            not, so that what it calls a hold depends only on the rollout's real start frame and the
            imagined arm, not on the imagined frames the policy also acts on; needs ``anchor``).

    Raises:
        ValueError: an image size not divisible by 16, ``channels`` not four widths, or
            ``wrist=False`` without ``anchor``.
    """

    def __init__(self, chunk_size: int, image_size=(64, 64), gripper_dim: int = -1,
                 channels=(32, 64, 64, 64), hidden: int = 256, dropout: float = 0.3, anchor: bool = False,
                 wrist: bool = True):
        super().__init__()
        if not wrist and not anchor:
            raise ValueError("a grasp head without the wrist frame (wrist=False) must read an anchor frame (anchor=True)")
        hw = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if hw[0] % 16 or hw[1] % 16:
            raise ValueError(f"the grasp head's camera image must be divisible by 16, got {hw}")
        if len(channels) != 4:
            raise ValueError(f"channels must give the widths of 4 convolutions, got {list(channels)}")
        self.chunk_size, self.gripper_dim = int(chunk_size), int(gripper_dim)
        def cnn():
            layers, c_in = [], 3
            for c in channels:
                layers += [nn.Conv2d(c_in, int(c), 4, 2, 1), nn.SiLU()]
                c_in = int(c)
            return nn.Sequential(*layers)

        feat = int(channels[-1]) * (hw[0] // 16) * (hw[1] // 16)
        self.wrist = bool(wrist)
        self.conv = cnn() if self.wrist else None
        self.anchor = bool(anchor)
        self.anchor_conv = cnn() if self.anchor else None
        d_in = (feat if self.wrist else 0) + 2 + self.chunk_size + 3 + 2 + ((feat + 6) if self.anchor else 0)
        self.mlp = nn.Sequential(nn.Dropout(float(dropout)), nn.Linear(d_in, hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 2))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, frame: torch.Tensor, proprio: torch.Tensor, actions: torch.Tensor,
                predicted: torch.Tensor, anchor: torch.Tensor | None = None) -> torch.Tensor:
        """Finger joints after the chunk, ``float32 (B, 2)`` (m).

        Args:
            frame: the camera's frame at the chunk's start, ``float32 (B, 3, Hi, Wi)`` in [-1, 1]
                (not read with ``wrist=False``; may be ``None`` then).
            proprio: ``(B, 9)`` at the chunk's start. actions: ``(B, H, D_a)`` (the gripper command in
                [-1, 1], > 0 closes). predicted: the dynamics' proprio after the chunk, ``(B, 9)``.
            anchor: with ``anchor=True``, the anchor camera's real frame of the rollout's start
                (``(B, 3, Hi, Wi)`` in [-1, 1]).

        Raises:
            ValueError: an anchor head called without ``anchor``.
        """
        grip = actions[..., self.gripper_dim].float().clamp(-1, 1)
        parts = [proprio[:, FINGERS].float() / GRIP_UNIT, grip,
                 (predicted[:, :3] - proprio[:, :3]).float() / POS_UNIT, predicted[:, FINGERS].float() / GRIP_UNIT]
        if self.wrist:
            parts.insert(0, self.conv(frame.float()).flatten(1))
        if self.anchor:
            if anchor is None:
                raise ValueError("this grasp head reads an anchor frame (anchor=True): pass anchor")
            c = proprio.new_tensor(TABLE_CENTRE_M)
            parts += [self.anchor_conv(anchor.float()).flatten(1), (proprio[:, :3].float() - c) / 0.1,
                      (predicted[:, :3].float() - c) / 0.1]
        return predicted[:, FINGERS].float() + 0.01 * self.mlp(torch.cat(parts, 1))

    def loss(self, frame: torch.Tensor, proprio: torch.Tensor, actions: torch.Tensor, predicted: torch.Tensor,
             target: torch.Tensor, anchor: torch.Tensor | None = None) -> torch.Tensor:
        """Smooth-L1 of the finger joints in 5 mm units against the recorded proprio after the chunk
        ``target`` ``(B, 9)``; the other arguments as :meth:`forward`."""
        pred = self.forward(frame, proprio, actions, predicted, anchor)
        return nn.functional.smooth_l1_loss(pred / 0.005, target[:, FINGERS].float() / 0.005)


__all__ = ["GraspHead", "FINGERS"]
