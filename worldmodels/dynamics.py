"""Proprio dynamics: an ensemble of small MLPs that predicts the arm's proprio at every control step
from the previous one and the action, with the commanded end-effector target as inductive bias.

For one control step ``k`` of member ``m``::

    tgt_k      = commanded position of action a_k           (absolute space: a_k[:3] clipped to a box of
                                                             target_box_m around p_k and to the
                                                             workspace; delta space:
                                                             p_k + delta_scale_m * a_k[:3])
    p_{k+1}    = p_k + A_m (tgt_k - p_k) + B_m (p_k - p_{k-1}) + 0.05 m * r_m[:3]
                                                            (target + residual: A_m = I, B_m = 0 at init)
    q_{k+1}    = normalize(q_k + 0.05 * r_m[3:7])
    g_{k+1}    = g_k + 0.01 m * r_m[7:9]
    r_m        = MLP_m((tgt_k - p_k) / 5 cm, (p_k - p_{k-1}) / 1 cm, rot6(q_k), g_k / 4 cm, (g_k - g_{k-1}) / 1 cm,
                       the action's other dims (yaw error for ``rotation = yaw_down``)
                       [, c_k, (g_tgt(c_k) - g_k) / 4 cm  with ``gripper_speed`` set])

with ``p`` the end-effector position, ``q`` its ``quat_wxyz`` and ``g`` the finger joints (the proprio
layout of ``wmrl.kernel.types``).

The gripper's commanded state (``gripper_speed`` set): robosuite's Panda gripper does not drive the
fingers from the action itself but from an integrator of its sign, ``c_{k+1} = clip(c_k + speed *
sign(a_k[gripper]), -1, 1)`` (``robosuite.models.grippers.PandaGripper.format_action``, speed 0.2 per
control step; ``c = +1`` closed), whose value sets the fingers' position targets ``g_tgt(c)`` (joint 7
at ``finger_range_m * (1 - c) / 2``, joint 8 the mirror image). That integrator is hidden state: from
the fingers alone a model cannot tell how far the command has run ahead of fingers in motion, or of
fingers stopped on a cube, and the finger errors compound over chunks. Here ``c`` is integrated
exactly from the actions inside a rollout and carried between chunks (``WMState.gripper_command``);
at a rollout's start it is estimated from the fingers as if they were at rest at their target
(:meth:`ProprioDynamics.command_at_rest`): exact at a reset (robosuite starts ``c`` at 0 with the
fingers half open) and for free fingers at rest, short of the true ``c`` for fingers stopped on an
object (whose target is then where they are anyway). ``A_m``, ``B_m`` (3 x 3 per member) are the linear part of the
residual: an impedance-controlled end effector is close to a damped second-order system driven by
its target, which they capture exactly (a least-squares fit of only these two terms predicts the ee
suite's held-out arm to 0.46 cm after one chunk, docs/measurements.md); the MLP models the rest
(contacts, the gripper, the orientation).

The orientation enters the MLP as ``rot6(q)``, the first two columns of its rotation matrix (a
continuous representation: Zhou et al. 2019, "On the Continuity of Rotation Representations in
Neural Networks"), and the quaternion loss is sign-invariant: ``q`` and ``-q`` are one rotation,
and robosuite's ``eef_quat`` flips between them (8.5 % of the control steps of the ee suite's expert
episodes, with the gripper pointing down ``w`` is near 0). Before, that flip dominated the loss and
the held-out one-chunk error stayed at 1.4 cm. Training unrolls the model over several chunks from a real start
(:meth:`ProprioDynamics.loss`), so it learns to stay where the actions put the arm instead of one
step's error; each member sees its own bootstrap mask of the batch. The members' disagreement (std
of the predicted position, m) is the uncertainty an imagined rollout can halt on (MOReL, Kidambi et
al. 2020; MOPO, Yu et al. 2020; the ensemble as in PETS, Chua et al. 2018).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from wmrl.kernel.pose import wrap_angle, yaw_of_down_quat
from wmrl.kernel.types import ActionSpace

POS_UNIT, VEL_UNIT, GRIP_UNIT = 0.05, 0.01, 0.04


def rot6(q: torch.Tensor) -> torch.Tensor:
    """The first two columns of the rotation matrix of ``quat_wxyz`` ``(..., 4)`` (unit), ``(..., 6)``:
    the same for ``q`` and ``-q``."""
    w, x, y, z = q.unbind(-1)
    return torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y + w * z), 2 * (x * z - w * y),
                        2 * (x * y - w * z), 1 - 2 * (x * x + z * z), 2 * (y * z + w * x)], -1)


class EnsembleLinear(nn.Module):
    """``K`` independent linear layers applied to ``(K, B, in)`` at once."""

    def __init__(self, k: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(k, d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(k, 1, d_out))
        bound = 1.0 / math.sqrt(d_in)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class ProprioDynamics(nn.Module):
    """Ensemble proprio dynamics (see the module docstring).

    Args:
        action_space: the ``ActionSpace`` (or its dict) of the actions; ``mode`` ``"absolute"``
            (position in the base frame = the commanded target) or ``"delta"`` (the target is the
            current position plus ``delta_scale_m * a[:3]``).
        state_dim: ``D_s`` (9: position, ``quat_wxyz``, two finger joints).
        ensemble: ``K`` members.
        hidden, depth: MLP width and number of hidden layers.
        target_box_m: absolute targets are clipped to this box around the current position (m), as
            the arm control clips them (``sim.control.EeTargetControl.max_step_m``).
        workspace_low, workspace_high: absolute targets are then clipped to this box (m, base
            frame), as the arm control does; default the action space's position bounds
            (``low[:3]`` / ``high[:3]``, which ``sim.control.EeTargetControl`` declares as its
            workspace). Unused in delta mode.
        delta_scale_m: metres per unit of a delta position action (robosuite OSC_POSE: 0.05).
        gripper_speed: ``None`` (the model sees only the fingers) or the gripper integrator's step per
            control step (robosuite's Panda gripper: 0.2): see the module docstring.
        finger_range_m: the travel of one finger joint (m; Panda: 0.04), for ``g_tgt(c)``.

    Raises:
        ValueError: ``state_dim != 9``, ``ensemble < 1``, or an action space whose mode is neither.
    """

    def __init__(self, action_space: ActionSpace | dict, state_dim: int = 9, ensemble: int = 5, hidden: int = 256,
                 depth: int = 2, target_box_m: float = 0.05, delta_scale_m: float = 0.05,
                 workspace_low=None, workspace_high=None, gripper_speed: float | None = None,
                 finger_range_m: float = 0.04):
        super().__init__()
        space = action_space if isinstance(action_space, ActionSpace) else ActionSpace.from_dict(dict(action_space))
        if state_dim != 9:
            raise ValueError(f"ProprioDynamics reads the 9-D proprio layout of wmrl.kernel.types, got state_dim={state_dim}")
        if ensemble < 1:
            raise ValueError(f"ensemble must be >= 1, got {ensemble}")
        if space.mode not in ("absolute", "delta"):
            raise ValueError(f"action space mode must be 'absolute' or 'delta', got {space.mode!r}")
        self.space, self.k = space, int(ensemble)
        self.target_box_m, self.delta_scale_m = float(target_box_m), float(delta_scale_m)
        absolute = space.mode == "absolute"
        lo = (space.low[:3] if absolute else (-math.inf,) * 3) if workspace_low is None else workspace_low
        hi = (space.high[:3] if absolute else (math.inf,) * 3) if workspace_high is None else workspace_high
        self.register_buffer("ws_low", torch.tensor([float(v) for v in lo]), persistent=False)
        self.register_buffer("ws_high", torch.tensor([float(v) for v in hi]), persistent=False)
        if self.ws_low.shape != (3,) or bool((self.ws_low >= self.ws_high).any()):
            raise ValueError(f"workspace_low < workspace_high (3 values each) needed, got {lo} and {hi}")
        # the linear part of the position residual, per member: A (tracking of the target), B (velocity)
        self.track = nn.Parameter(torch.eye(3).repeat(self.k, 1, 1))
        self.carry = nn.Parameter(torch.zeros(self.k, 3, 3))
        self.gripper_speed = None if gripper_speed is None else float(gripper_speed)
        self.finger_range_m = float(finger_range_m)
        d_in = 3 + 3 + 6 + 2 + 2 + (space.dim - 3) + (0 if self.gripper_speed is None else 3)
        dims = [d_in] + [int(hidden)] * int(depth) + [9]
        self.layers = nn.ModuleList(EnsembleLinear(self.k, a, b) for a, b in zip(dims[:-1], dims[1:]))
        with torch.no_grad():  # start at "the arm is at the commanded target"
            self.layers[-1].weight.mul_(0.01)

    # ------------------------------------------------------------------ one step
    def commanded(self, pos: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """The commanded position ``(..., 3)`` (m, base frame) of ``action`` ``(..., D_a)`` at ``pos``."""
        if self.space.mode == "absolute":
            tgt = torch.minimum(torch.maximum(action[..., :3], pos - self.target_box_m), pos + self.target_box_m)
            return torch.minimum(torch.maximum(tgt, self.ws_low), self.ws_high)
        return pos + self.delta_scale_m * action[..., :3]

    def _other_action_dims(self, s: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        rest = action[..., 3:]
        if self.space.rotation == "yaw_down":  # the yaw error, wrapped, in place of the yaw target
            err = wrap_angle(rest[..., :1] - yaw_of_down_quat(s[..., 3:7]).unsqueeze(-1))
            rest = torch.cat([err, rest[..., 1:]], -1)
        return rest

    # ------------------------------------------------------------------ the gripper's command
    def finger_targets(self, c: torch.Tensor) -> torch.Tensor:
        """The finger joints' position targets ``(..., 2)`` (m) of gripper commands ``c`` ``(...)`` in [-1, 1]."""
        j = self.finger_range_m * (1 - c) / 2
        return torch.stack([j, -j], -1)

    def command_at_rest(self, s: torch.Tensor) -> torch.Tensor:
        """The gripper command ``(...)`` whose finger targets are where the fingers of proprio ``s``
        ``(..., 9)`` are (the estimate at a rollout's start; module docstring)."""
        gap = s[..., 7] - s[..., 8]
        return (1 - gap / self.finger_range_m).clamp(-1, 1)

    def commands(self, c0: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """The gripper command before each step and after the last, ``(B, T + 1)``, from ``c0`` ``(B,)``
        under ``actions`` ``(B, T, D_a)`` (the gripper is the last action dim)."""
        out, c = [c0], c0
        for t in range(actions.shape[1]):
            c = (c + self.gripper_speed * torch.sign(actions[:, t, -1])).clamp(-1, 1)
            out.append(c)
        return torch.stack(out, 1)

    def step(self, s: torch.Tensor, s_prev: torch.Tensor, action: torch.Tensor,
             command: torch.Tensor | None = None) -> torch.Tensor:
        """Next proprio ``(K, B, 9)`` from ``s``, ``s_prev`` ``(K, B, 9)`` and ``action`` ``(B, D_a)`` (or
        ``(K, B, D_a)``); ``command``: the gripper command ``(B,)`` after this step's action (with
        ``gripper_speed``)."""
        a = action.expand(self.k, *action.shape[-2:]) if action.dim() == 2 else action
        pos, q, g = s[..., :3], s[..., 3:7], s[..., 7:9]
        tgt = self.commanded(pos, a)
        feats = [(tgt - pos) / POS_UNIT, (pos - s_prev[..., :3]) / VEL_UNIT, rot6(q), g / GRIP_UNIT,
                 (g - s_prev[..., 7:9]) / VEL_UNIT, self._other_action_dims(s, a)]
        if self.gripper_speed is not None:
            c = command.expand(self.k, command.shape[-1]).unsqueeze(-1)
            feats += [c, (self.finger_targets(c.squeeze(-1)) - g) / GRIP_UNIT]
        x = torch.cat(feats, -1)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.silu(x)
        q_next = q + 0.05 * x[..., 3:7]
        q_next = q_next / q_next.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        lin = pos + torch.einsum("kbi,kji->kbj", tgt - pos, self.track) \
            + torch.einsum("kbi,kji->kbj", pos - s_prev[..., :3], self.carry)
        return torch.cat([lin + POS_UNIT * x[..., :3], q_next, g + 0.01 * x[..., 7:9]], -1)

    # ------------------------------------------------------------------ rollouts
    def rollout(self, s0: torch.Tensor, actions: torch.Tensor, s_prev0: torch.Tensor | None = None,
                command0: torch.Tensor | None = None, return_command: bool = False):
        """Proprio after each of ``T`` steps, ``(K, B, T, 9)``, from ``s0`` ``(B, 9)`` (and the step
        before it, ``s_prev0``; default ``s0``: at rest) under ``actions`` ``(B, T, D_a)``.

        With ``gripper_speed``: ``command0`` ``(B,)`` is the gripper command at the start (``None``:
        :meth:`command_at_rest` of ``s0``), and ``return_command=True`` returns ``(states, command
        after the last step (B,))`` (``None`` without ``gripper_speed``)."""
        s = s0.unsqueeze(0).expand(self.k, *s0.shape)
        sp = s if s_prev0 is None else s_prev0.unsqueeze(0).expand(self.k, *s0.shape)
        cmd = None
        if self.gripper_speed is not None:
            cmd = self.commands(self.command_at_rest(s0) if command0 is None else command0.to(s0), actions)
        out = []
        for t in range(actions.shape[1]):
            s, sp = self.step(s, sp, actions[:, t], None if cmd is None else cmd[:, t + 1]), s
            out.append(s)
        states = torch.stack(out, 2)
        if return_command:
            return states, None if cmd is None else cmd[:, -1]
        return states

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """Unrolled loss of a window: ``batch["proprio"]`` ``float32 (B, T + 2, 9)`` (the step before
        the start, the start, then ``T`` steps), ``batch["actions"]`` ``(B, T, D_a)`` (the actions
        at the start and after), optional ``batch["mask"]`` ``(K, B)`` bootstrap weights.
        Position error in cm, quaternion error x10, finger error in 5 mm units, squared and averaged."""
        p, a = batch["proprio"], batch["actions"]
        pred = self.rollout(p[:, 1], a, p[:, 0])
        real = p[:, 2:].unsqueeze(0)
        q_real = real[..., 3:7] * torch.where((pred[..., 3:7] * real[..., 3:7]).sum(-1, keepdim=True) < 0, -1.0, 1.0)
        err = torch.cat([(pred[..., :3] - real[..., :3]) / 0.01, (pred[..., 3:7] - q_real) * 10,
                         (pred[..., 7:9] - real[..., 7:9]) / 0.005], -1).pow(2).mean(-1)  # (K, B, T)
        mask = batch.get("mask")
        per = err.mean(-1) if mask is None else err.mean(-1) * mask
        loss = per.sum() / (per.numel() if mask is None else mask.sum().clamp_min(1.0))
        pos_cm = (pred[..., :3] - real[..., :3]).norm(dim=-1).mean(0)[:, -1].mean() * 100
        return loss, {"loss": float(loss.detach()), "end_pos_err_cm": float(pos_cm.detach())}

    @torch.no_grad()
    def disagreement(self, states: torch.Tensor) -> torch.Tensor:
        """Std over members of the predicted position (m), ``(B, T)``, of rollout states ``(K, B, T, 9)``."""
        return states[..., :3].std(0).norm(dim=-1) if self.k > 1 else states.new_zeros(states.shape[1:3])


__all__ = ["ProprioDynamics", "EnsembleLinear", "rot6"]
