"""Action-conditioned video world model: x-prediction flow matching on frame residuals.

Given the current frames of every camera (stacked on channels, so the cameras are generated
jointly and stay consistent), the proprio state and an action chunk ``(B, H, D_a)``, the model
generates the frames and proprio after the chunk (step ``t + H``).

Method (chosen for few-step sampling on CPU; its figures: docs/measurements.md, "World model"):

* Rectified flow / flow matching in diffusers' convention ``z_s = (1 - s) x + s * eps`` with
  ``s`` the noise level (Lipman et al. 2023, "Flow Matching for Generative Modeling"; Liu et al.
  2023, "Rectified Flow"); sampling with diffusers' ``FlowMatchEulerDiscreteScheduler``.
* The network predicts the clean target ``x`` (x-prediction, as in DIAMOND's EDM denoiser,
  Alonso et al. 2024) rather than the velocity, so that one step at ``s = 1`` is already a
  regression onto the conditional mean; the velocity handed to the scheduler is
  ``(z_s - x_hat) / s``.
* The target is the *residual* ``x = frame_{t+H} - frame_t`` (in [-2, 2]); the output layer starts
  at zero, so an untrained model is exactly the copy-last-frame baseline.
* A deterministic predictor path: with zero noise at ``s = 1`` (trained explicitly on a fraction
  of the batches) the model is a deterministic regressor; ``stochastic=True`` with a
  ``torch.Generator`` gives seeded samples.
* The action chunk (and proprio) is embedded by an MLP and added to the timestep embedding of a
  diffusers ``UNet2DModel`` (``class_embed_type="identity"``, FiLM ``scale_shift`` in every ResNet
  block), so the actions condition every block. The frames are space-to-depth'ed by ``patch``
  first (downsample at once), which is what makes CPU training affordable.
* Proprio after the chunk: an MLP on (proprio, actions, pooled frames) predicting the normalised
  change; or, with ``dynamics`` set, the ensemble of ``worldmodels.dynamics.ProprioDynamics``
  (every control step, the commanded target as its prior, trained with an unrolled multi-chunk
  loss), whose prediction of the proprio after the chunk also conditions the frames, and whose
  members' disagreement is carried in ``WMState.uncertainty`` (m) for the imagination to halt on.
* With ``anchor`` set, the frames are also conditioned on the real frames the rollout started from
  (WoVR keeps the real first frame as conditioning for the whole rollout): the static camera's anchor
  as it is, and a hand camera's anchor reprojected to the predicted pose after the chunk through the
  table plane (``worldmodels.reproject.PlaneReprojection``), so the cubes keep their place and
  sharpness in the wrist view instead of washing out after one chunk. Needs ``dynamics`` for the
  predicted pose.
* With ``grasp`` set as well, the finger joints after the chunk come from
  ``worldmodels.grasp.GraspHead``: the dynamics' prediction corrected from the full-resolution wrist
  frame at the chunk's start (whether the fingers will stop on a cube is visible there, not in the arm).

Scaling (resolution, width, depth, attention, patch) is configuration only.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler, UNet2DModel

from wmrl.kernel.precision import Precision, normalise_setting, resolve_bf16
from wmrl.kernel.types import Obs
from worldmodels.data import split_cameras, stack_cameras
from worldmodels.state import WMState, to_uint8, to_unit  # noqa: F401 (re-exported: the model's state)


class ChunkFlowWorldModel(nn.Module):
    """Implements ``wmrl.kernel.interfaces.WorldModel``: ``init(Obs) -> WMState``,
    ``imagine(WMState, actions (B, H, D_a), generator) -> (WMState, Obs)``.

    Args:
        cameras: camera names, stacking order (all at ``image_size``).
        image_size: ``(Hi, Wi)`` or an int; must be divisible by ``patch * 2 ** (len(blocks) - 1)``.
        state_dim: ``D_s``. action_dim: ``D_a`` (``None``: 7, the OSC_POSE delta space). chunk_size: ``H``
            (the chunk the model predicts over).
        block_out_channels: UNet widths per resolution level (after space-to-depth).
        layers_per_block: ResNet layers per level.
        attention_levels: indices of levels that use self-attention blocks (``[]`` for none).
        patch: space-to-depth factor applied before the UNet (1 = none).
        sampling_steps: ``K`` Euler steps of the flow sampler (1 or 2 is the CPU sweet spot).
        stochastic: draw the initial noise (``True``) or use the deterministic path (``False``).
        noise_scale: std of the initial noise relative to the residual scale.
        dynamics: ``None`` (the proprio MLP head) or the keyword arguments of
            ``worldmodels.dynamics.ProprioDynamics`` (``action_space`` and the ensemble's sizes;
            the pipeline fills ``action_space`` from the store): see the module docstring.
        grasp: ``None`` or the keyword arguments of ``worldmodels.grasp.GraspHead`` plus ``camera``
            (default ``robot0_eye_in_hand``) and ``anchor_camera`` (``None``: no anchor; e.g.
            ``agentview``: the head also reads that camera's real frame of the rollout's start,
            ``WMState.anchor``): the finger-gap head; needs ``dynamics``.
        anchor: ``None`` or ``{"reproject": None | {"camera": name, "fovy_deg", "mount_pos_m",
            "mount_rot", "plane_z_m"}}``: condition the frames on the rollout's real start frames
            (``WMState.anchor``); ``reproject`` names a camera mounted on the end effector and its
            geometry (``worldmodels.reproject.PlaneReprojection``; the Panda wrist camera's in
            ``configs/worldmodel/anchor.yaml``), whose anchor is warped to the predicted pose. Needs ``dynamics``.
        action_low, action_high: the action space's bounds, a float for every dim or one per dim
            (``D_a`` values; ``None``: -1 / 1, the OSC_POSE delta space). Actions are clipped to them
            and mapped to [-1, 1] per dim before they condition the model (for the delta space, an
            identity). The pipeline fills them from the store's ``ActionSpace`` (``wmrl.run.data``).
        autocast_bf16: bfloat16 autocast of the networks: ``"auto"`` (only where the device runs bf16
            natively), ``True`` or ``False``; resolved per device type by ``wmrl.kernel.precision.resolve_bf16``
            when the model first runs there (:meth:`precision`).

    Normalisation stats (proprio mean / std, std of the proprio change over a chunk) are buffers
    set by :meth:`set_norm_stats` and saved with the weights; using an unfitted model raises.

    Declared capabilities: ``action_dim``, ``chunk_size`` and ``context_frames = 1`` (``init``
    conditions on the last context frame only); ``UncertainWorldModel`` (:meth:`uncertainty`) and
    ``SlotStateWorldModel`` (:meth:`merge_states`).
    """

    context_frames = 1

    def __init__(self, cameras: Sequence[str] = ("agentview", "robot0_eye_in_hand"), image_size=64,
                 state_dim: int = 9, action_dim: int | None = 7, chunk_size: int = 8,
                 block_out_channels: Sequence[int] = (64, 128, 128), layers_per_block: int = 1,
                 attention_levels: Sequence[int] = (), patch: int = 2, sampling_steps: int = 1,
                 stochastic: bool = False, noise_scale: float = 1.0, action_low: float | Sequence[float] | None = -1.0,
                 action_high: float | Sequence[float] | None = 1.0, autocast_bf16: bool | str = "auto", proprio_hidden: int = 256,
                 norm_num_groups: int = 16, dynamics: dict | None = None, grasp: dict | None = None,
                 anchor: dict | None = None):
        super().__init__()
        hw = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        action_dim = 7 if action_dim is None else int(action_dim)  # None: the OSC_POSE delta space's
        levels = len(block_out_channels)
        div = patch * 2 ** (levels - 1)
        if hw[0] % div or hw[1] % div:
            raise ValueError(f"image_size {hw} must be divisible by patch * 2**(levels-1) = {div}; "
                             "change image_size, patch or block_out_channels")
        if sampling_steps < 1:
            raise ValueError(f"sampling_steps must be >= 1, got {sampling_steps}")
        for c in block_out_channels:
            if c % norm_num_groups:
                raise ValueError(f"block_out_channels {list(block_out_channels)} must be multiples of "
                                 f"norm_num_groups={norm_num_groups}")
        self.cameras = list(cameras)
        self.image_size = hw
        self.state_dim, self.action_dim, self.chunk_size = state_dim, action_dim, chunk_size
        self.patch = patch
        self.sampling_steps = sampling_steps
        self.stochastic = stochastic
        self.noise_scale = noise_scale
        lo = torch.as_tensor(-1.0 if action_low is None else action_low, dtype=torch.float32).flatten()
        hi = torch.as_tensor(1.0 if action_high is None else action_high, dtype=torch.float32).flatten()
        if lo.numel() not in (1, action_dim) or hi.numel() not in (1, action_dim) or bool((lo.expand(action_dim) >= hi.expand(action_dim)).any()):
            raise ValueError(f"action_low < action_high needed, one value or D_a={action_dim} each; got {action_low} "
                             f"and {action_high}")
        # per-dim bounds, not saved in checkpoints (they are constructor arguments)
        self.register_buffer("action_low", lo.expand(action_dim).clone(), persistent=False)
        self.register_buffer("action_high", hi.expand(action_dim).clone(), persistent=False)
        self.autocast_bf16 = autocast_bf16
        normalise_setting(autocast_bf16)  # a bad setting fails here, not at the first forward pass
        self._precision: dict[str, Precision] = {}
        c_img = 3 * len(self.cameras)
        self.c_img = c_img
        temb = block_out_channels[0] * 4
        down = tuple("AttnDownBlock2D" if i in attention_levels else "DownBlock2D" for i in range(levels))
        up = tuple("AttnUpBlock2D" if (levels - 1 - i) in attention_levels else "UpBlock2D" for i in range(levels))
        self.anchor_frames = anchor is not None
        self.reproject, self.reproject_camera = None, None
        if anchor is not None:
            unknown = set(anchor) - {"reproject"}
            if unknown:
                raise ValueError(f"unknown anchor options {sorted(unknown)}; known: ['reproject']")
            if dynamics is None:
                raise ValueError("anchor conditioning needs the predicted pose after each chunk: set dynamics as well")
            rp = anchor.get("reproject")
            if rp is not None:
                from worldmodels.reproject import PlaneReprojection

                rp = dict(rp)
                cam = rp.pop("camera")
                if cam not in self.cameras:
                    raise ValueError(f"anchor.reproject.camera {cam!r} is not one of the model's cameras {self.cameras}")
                self.reproject_camera = self.cameras.index(cam)
                self.reproject = PlaneReprojection(**rp)
        self.unet = UNet2DModel(
            sample_size=(hw[0] // patch, hw[1] // patch),
            in_channels=(3 if self.anchor_frames else 2) * c_img * patch * patch, out_channels=c_img * patch * patch,
            block_out_channels=tuple(block_out_channels), layers_per_block=layers_per_block,
            down_block_types=down, up_block_types=up, class_embed_type="identity",
            resnet_time_scale_shift="scale_shift", norm_num_groups=norm_num_groups,
            add_attention=bool(attention_levels), attention_head_dim=8,
        )
        nn.init.zeros_(self.unet.conv_out.weight)   # start exactly at copy-last-frame
        nn.init.zeros_(self.unet.conv_out.bias)
        cond_in = chunk_size * action_dim + state_dim
        self.dynamics = None
        if dynamics is not None:
            from worldmodels.dynamics import ProprioDynamics

            self.dynamics = ProprioDynamics(state_dim=state_dim, **dynamics)
            if self.dynamics.space.dim != action_dim:
                raise ValueError(f"dynamics.action_space has D_a={self.dynamics.space.dim}, the model action_dim={action_dim}")
            cond_in += state_dim   # the frames are also conditioned on the predicted proprio after the chunk
        self.grasp, self.grasp_camera, self.grasp_anchor_camera = None, None, None
        if grasp is not None:
            from worldmodels.grasp import GraspHead

            kw = dict(grasp)
            cam = kw.pop("camera", "robot0_eye_in_hand")
            anchor_cam = kw.pop("anchor_camera", None)
            if self.dynamics is None:
                raise ValueError("the grasp head corrects the dynamics' finger joints: set dynamics as well")
            for c in [cam] + ([] if anchor_cam is None else [anchor_cam]):
                if c not in self.cameras:
                    raise ValueError(f"grasp camera {c!r} is not one of the model's cameras {self.cameras}")
            self.grasp_camera = self.cameras.index(cam)
            self.grasp_anchor_camera = None if anchor_cam is None else self.cameras.index(anchor_cam)
            self.grasp = GraspHead(chunk_size, hw, anchor=anchor_cam is not None, **kw)
        self.cond_mlp = nn.Sequential(nn.Linear(cond_in, temb), nn.SiLU(), nn.Linear(temb, temb))
        pooled = c_img * 8 * 8
        if self.dynamics is None:
            self.proprio_head = nn.Sequential(
                nn.Linear(cond_in + pooled, proprio_hidden), nn.SiLU(),
                nn.Linear(proprio_hidden, proprio_hidden), nn.SiLU(), nn.Linear(proprio_hidden, state_dim))
            nn.init.zeros_(self.proprio_head[-1].weight)
            nn.init.zeros_(self.proprio_head[-1].bias)
        self.register_buffer("proprio_mean", torch.zeros(state_dim))
        self.register_buffer("proprio_std", torch.ones(state_dim))
        self.register_buffer("delta_std", torch.ones(state_dim))
        self.register_buffer("stats_fitted", torch.zeros((), dtype=torch.bool))

    # ------------------------------------------------------------------ normalisation
    @torch.no_grad()
    def set_norm_stats(self, proprio: torch.Tensor, delta: torch.Tensor) -> None:
        """Fit proprio stats from ``proprio (N, D_s)`` and chunk changes ``delta (N, D_s)``.
        Zero-variance dimensions get std 1e-3-floored (never NaN)."""
        self.proprio_mean.copy_(proprio.float().mean(0))
        self.proprio_std.copy_(proprio.float().std(0).nan_to_num(0.0).clamp_min(1e-3))
        self.delta_std.copy_(delta.float().std(0).nan_to_num(0.0).clamp_min(1e-3))
        self.stats_fitted.fill_(True)

    def _check_stats(self):
        if not bool(self.stats_fitted):
            raise RuntimeError("ChunkFlowWorldModel has no normalisation stats; call set_norm_stats(...) "
                               "before use or load a trained checkpoint")

    # ------------------------------------------------------------------ network pieces
    def precision(self) -> Precision:
        """The precision this model runs at on its current device (dtype and why)."""
        dev = self.proprio_mean.device.type
        if dev not in self._precision:
            self._precision[dev] = resolve_bf16(self.autocast_bf16, dev, "world model")
        return self._precision[dev]

    def _autocast(self):
        dev = self.proprio_mean.device.type
        return torch.autocast(dev, dtype=torch.bfloat16, enabled=self.precision().bf16)

    def condition(self, proprio: torch.Tensor, actions: torch.Tensor, next_proprio: torch.Tensor | None = None) -> torch.Tensor:
        """``float32 (B, H*D_a + D_s)``: actions clipped to the action space and mapped to [-1, 1]
        per dim, and normalised proprio; with ``dynamics`` also the (predicted, or in training the
        recorded) normalised proprio after the chunk ``next_proprio`` (``(B, H*D_a + 2 D_s)``)."""
        if actions.ndim != 3 or actions.shape[1] != self.chunk_size or actions.shape[2] != self.action_dim:
            raise ValueError(f"actions must be (B, H={self.chunk_size}, D_a={self.action_dim}), got "
                             f"{tuple(actions.shape)}; the world model was trained for that chunk shape")
        lo, hi = self.action_low, self.action_high
        a = ((actions.float().clamp(lo, hi) - (hi + lo) / 2) / ((hi - lo) / 2)).flatten(1)
        p = (proprio.float() - self.proprio_mean) / self.proprio_std
        if self.dynamics is None:
            return torch.cat([a, p], dim=1)
        if next_proprio is None:
            raise ValueError("a world model with dynamics conditions the frames on the proprio after the chunk: "
                             "pass next_proprio (imagine() predicts it)")
        return torch.cat([a, p, (next_proprio.float() - self.proprio_mean) / self.proprio_std], dim=1)

    def predict_proprio(self, state: "WMState", actions: torch.Tensor, return_command: bool = False):
        """With ``dynamics``: the ensemble-mean proprio after the chunk and one step before it
        (``float32 (B, D_s)`` each) and the members' disagreement at the chunk's end (``(B,)``, m);
        with ``return_command`` also the gripper command after the chunk (``(B,)`` or ``None``, see
        ``WMState.gripper_command``). With ``grasp``, the finger joints after the chunk are the grasp
        head's, and the step before is shifted by the same correction (the fingers' velocity stays
        the dynamics')."""
        prev = state.proprio if state.prev_proprio is None else state.prev_proprio
        states, cmd = self.dynamics.rollout(state.proprio.float(), actions.float(), prev.float(),
                                            command0=state.gripper_command, return_command=True)   # (K, B, H, D_s)
        mean = states.mean(0)
        q = mean[..., 3:7] / mean[..., 3:7].norm(dim=-1, keepdim=True).clamp_min(1e-6)
        mean = torch.cat([mean[..., :3], q, mean[..., 7:]], -1)
        before = mean[:, -2] if mean.shape[1] > 1 else state.proprio.float()
        end = mean[:, -1]
        if self.grasp is not None:
            anchor_p = state.proprio if state.anchor_proprio is None else state.anchor_proprio
            fingers = self.grasp(self.grasp_frame(state.frames), state.proprio, actions, end,
                                 self.grasp_anchor_view(state.frames if state.anchor is None else state.anchor, anchor_p, end))
            shift = fingers - end[:, 7:9]
            end = torch.cat([end[:, :7], fingers, end[:, 9:]], -1)
            before = torch.cat([before[:, :7], before[:, 7:9] + shift, before[:, 9:]], -1)
        out = (end, before, self.dynamics.disagreement(states)[:, -1])
        return out + (cmd,) if return_command else out

    def grasp_frame(self, frames: torch.Tensor, anchor: bool = False) -> torch.Tensor | None:
        """The grasp head's camera (``anchor``: its anchor camera; ``None`` without one) out of stacked
        ``frames`` ``(B, 3 * n_cam, Hi, Wi)``: ``(B, 3, Hi, Wi)``."""
        cam = self.grasp_anchor_camera if anchor else self.grasp_camera
        if cam is None:
            return None
        return frames[:, 3 * cam:3 * cam + 3]

    def grasp_anchor_view(self, anchor: torch.Tensor, anchor_proprio: torch.Tensor, pose: torch.Tensor) -> torch.Tensor | None:
        """The grasp head's anchor input ``(B, 3, Hi, Wi)`` (``None`` without an anchor camera): the anchor
        camera's frame out of stacked ``anchor`` frames, reprojected from ``anchor_proprio`` to the pose
        ``pose`` (``(B, D_s)``, the predicted pose after the chunk) when it is the model's ``reproject``
        camera (``worldmodels.reproject``): then the head sees the real start frame from where the
        fingers close."""
        view = self.grasp_frame(anchor, anchor=True)
        if view is None or self.reproject is None or self.grasp_anchor_camera != self.reproject_camera:
            return view
        return self.reproject(view, anchor_proprio, pose)

    def grasp_loss(self, frames_u8: torch.Tensor, proprio: torch.Tensor, prev_proprio: torch.Tensor,
                   actions: torch.Tensor, next_proprio: torch.Tensor, anchor_u8: torch.Tensor | None = None,
                   anchor_proprio: torch.Tensor | None = None) -> torch.Tensor:
        """The finger-gap head's loss (``GraspHead.loss``) on chunk windows: stacked ``frames_u8``
        ``uint8 (B, 3 * n_cam, Hi, Wi)`` at the start, ``proprio`` / ``prev_proprio`` ``(B, D_s)``, ``actions``
        ``(B, H, D_a)``, the recorded ``next_proprio`` ``(B, D_s)``, and for an anchor head the stacked
        anchor frames ``anchor_u8`` (``None``: ``frames_u8``) with their proprio ``anchor_proprio`` (``None``:
        ``proprio``). The dynamics' prediction it corrects is not trained by this loss. Raises ``RuntimeError`` without ``grasp``."""
        if self.grasp is None:
            raise RuntimeError("this world model has no grasp head (grasp=None)")
        with torch.no_grad():
            states = self.dynamics.rollout(proprio.float(), actions.float(), prev_proprio.float())
        end = states.mean(0)[:, -1]
        anchor = self.grasp_anchor_view(to_unit(frames_u8 if anchor_u8 is None else anchor_u8),
                                        proprio if anchor_proprio is None else anchor_proprio, end)
        return self.grasp.loss(self.grasp_frame(to_unit(frames_u8)), proprio, actions, end, next_proprio, anchor)

    def aligned_anchor(self, anchor: torch.Tensor, anchor_proprio: torch.Tensor, next_proprio: torch.Tensor) -> torch.Tensor:
        """The anchor frames ``float32 (B, 3*n_cam, Hi, Wi)`` in [-1, 1] as conditioning for the frames
        after the chunk: every camera as it is, the ``reproject`` camera warped from the anchor's pose
        ``anchor_proprio`` to ``next_proprio`` (``(B, D_s)``; position and ``quat_wxyz`` first)."""
        if self.reproject is None:
            return anchor.float()
        c = 3 * self.reproject_camera
        warped = self.reproject(anchor[:, c:c + 3], anchor_proprio, next_proprio)
        return torch.cat([anchor[:, :c].float(), warped, anchor[:, c + 3:].float()], 1)

    def denoise(self, z: torch.Tensor, sigma: torch.Tensor, frames: torch.Tensor, cond: torch.Tensor,
                anchor: torch.Tensor | None = None) -> torch.Tensor:
        """x-prediction: residual estimate ``float32 (B, 3*n_cam, Hi, Wi)`` from the noisy residual
        ``z`` at noise level ``sigma (B,)`` in [0, 1], current ``frames`` in [-1, 1], ``cond`` and, for
        a model with ``anchor``, the aligned anchor frames (:meth:`aligned_anchor`)."""
        if self.anchor_frames and anchor is None:
            raise ValueError("this world model is conditioned on anchor frames: pass anchor (aligned_anchor)")
        x = torch.cat([z, frames] + ([anchor] if self.anchor_frames else []), dim=1)
        if self.patch > 1:
            x = F.pixel_unshuffle(x, self.patch)
        with self._autocast():
            emb = self.cond_mlp(cond)
            out = self.unet(x, sigma * 1000.0, class_labels=emb).sample
        out = out.float()
        if self.patch > 1:
            out = F.pixel_shuffle(out, self.patch)
        return out

    def proprio_delta(self, frames: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Normalised proprio change over the chunk, ``float32 (B, D_s)``."""
        pooled = F.adaptive_avg_pool2d(frames, 8).flatten(1)
        with self._autocast():
            return self.proprio_head(torch.cat([cond, pooled], dim=1)).float()

    # ------------------------------------------------------------------ WorldModel protocol
    def init(self, context: Obs) -> WMState:
        """State from the current observation ``context`` (batch ``B``; the last frame of a history
        is all this model conditions on). Raises ``ValueError``/``KeyError`` on wrong cameras/shapes."""
        context.validate()
        frames = stack_cameras(context.images, self.cameras)
        if tuple(frames.shape[-2:]) != self.image_size:
            raise ValueError(f"context images are {tuple(frames.shape[-2:])}, the model expects {self.image_size}")
        dev = self.proprio_mean.device
        if context.proprio.shape[1] != self.state_dim:
            raise ValueError(f"context proprio has D_s={context.proprio.shape[1]}, the model expects {self.state_dim}")
        frames, proprio = to_unit(frames.to(dev)), context.proprio.float().to(dev)
        cmd = None
        if self.dynamics is not None and self.dynamics.gripper_speed is not None:
            cmd = self.dynamics.command_at_rest(proprio)
        keep = self.keeps_anchor
        return WMState(frames, proprio, list(context.task), gripper_command=cmd, anchor=frames if keep else None,
                       anchor_proprio=proprio if keep else None)

    @property
    def keeps_anchor(self) -> bool:
        """Whether imagined states carry the rollout's start frames (``anchor`` or a grasp anchor camera)."""
        return self.anchor_frames or self.grasp_anchor_camera is not None

    def merge_states(self, state: WMState, slots: torch.Tensor, other: WMState) -> WMState:
        """``wmrl.kernel.interfaces.SlotStateWorldModel``: ``state`` with the slots ``slots``
        (``bool (B,)``) from ``other`` (``WMState.merge``)."""
        return state.merge(slots, other)

    def uncertainty(self, state: WMState) -> torch.Tensor | None:
        """``wmrl.kernel.interfaces.UncertainWorldModel``: the dynamics ensemble's disagreement at the
        end of the last imagined chunk (``float32 (B,)``, m); ``None`` without ``dynamics`` or for an
        ``init``-ed state."""
        return state.uncertainty

    @torch.no_grad()
    def imagine(self, state: WMState, actions: torch.Tensor,
                generator: torch.Generator | None = None) -> tuple[WMState, Obs]:
        """Predict the observation after executing ``actions float32 (B, H, D_a)`` from ``state``.

        With ``stochastic=False`` the result is deterministic (``generator`` ignored); otherwise the
        initial noise is drawn from ``generator`` (seeded samples) and refined in
        ``sampling_steps`` Euler steps.

        Returns:
            the new ``WMState`` and the predicted ``Obs`` (uint8 images per camera, proprio, task).
        """
        self._check_stats()
        if actions.shape[0] != state.frames.shape[0]:
            raise ValueError(f"actions batch {actions.shape[0]} != state batch {state.frames.shape[0]}")
        actions = actions.to(state.frames.device)
        proprio = before = unc = cmd = None
        if self.dynamics is not None:   # the arm first: the frames are conditioned on it
            proprio, before, unc, cmd = self.predict_proprio(state, actions, return_command=True)
        anchor = (state.frames if state.anchor is None else state.anchor) if self.keeps_anchor else None
        anchor_p = (state.proprio if state.anchor_proprio is None else state.anchor_proprio) if self.keeps_anchor else None
        residual = self.sample_residual(state.frames, state.proprio, actions, generator, next_proprio=proprio,
                                        anchor=anchor, anchor_proprio=anchor_p)
        frames = (state.frames + residual).clamp(-1, 1)
        if self.dynamics is None:
            cond = self.condition(state.proprio, actions)
            proprio = state.proprio + self.proprio_delta(state.frames, cond) * self.delta_std
        new = WMState(frames, proprio, list(state.task), before, unc, cmd, anchor, anchor_p)
        obs = Obs(images=split_cameras(to_uint8(frames), self.cameras), proprio=proprio.float(), task=list(state.task))
        return new, obs

    def sample_residual(self, frames: torch.Tensor, proprio: torch.Tensor, actions: torch.Tensor,
                        generator: torch.Generator | None = None, next_proprio: torch.Tensor | None = None,
                        anchor: torch.Tensor | None = None, anchor_proprio: torch.Tensor | None = None) -> torch.Tensor:
        """Run the flow sampler: ``float32 (B, 3*n_cam, Hi, Wi)`` residual frame_{t+H} - frame_t
        (``next_proprio``: see :meth:`condition`; with ``dynamics`` and ``None``, predicted from
        ``proprio`` at rest; ``anchor`` / ``anchor_proprio``: the rollout's start frames in [-1, 1] and
        their proprio for a model with ``anchor``, ``None``: ``frames`` / ``proprio``)."""
        if self.dynamics is not None and next_proprio is None:
            next_proprio = self.predict_proprio(WMState(frames, proprio, [""] * frames.shape[0]), actions)[0]
        cond = self.condition(proprio, actions, next_proprio)
        aligned = None
        if self.anchor_frames:
            aligned = self.aligned_anchor(frames if anchor is None else anchor,
                                          proprio if anchor_proprio is None else anchor_proprio, next_proprio)
        b = frames.shape[0]
        if self.stochastic:
            z = torch.randn(frames.shape, generator=generator, device=frames.device) * self.noise_scale
        else:
            z = torch.zeros_like(frames)
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
        sigmas = [1.0 - k / self.sampling_steps for k in range(self.sampling_steps)]
        sched.set_timesteps(sigmas=sigmas, device=frames.device)
        x_hat = z
        for i, t in enumerate(sched.timesteps):
            s = float(sched.sigmas[i])
            x_hat = self.denoise(z, torch.full((b,), s, device=frames.device), frames, cond, aligned)
            if i == len(sched.timesteps) - 1:
                break
            velocity = (z - x_hat) / s          # diffusers' flow convention: d z / d sigma
            z = sched.step(velocity, t, z, return_dict=False)[0]
        return x_hat

    # ------------------------------------------------------------------ training
    def loss(self, frames_u8: torch.Tensor, proprio: torch.Tensor, actions: torch.Tensor,
             next_frames_u8: torch.Tensor, next_proprio: torch.Tensor, generator: torch.Generator | None = None,
             p_deterministic: float = 0.25, p_pure_noise: float = 0.25, anchor_u8: torch.Tensor | None = None,
             anchor_proprio: torch.Tensor | None = None, frames: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Flow-matching x-prediction loss on a batch of chunk windows.

        For a model with ``anchor``: ``anchor_u8`` ``uint8 (B, 3*n_cam, Hi, Wi)`` and ``anchor_proprio``
        ``(B, D_s)`` are the rollout-start frames the window is conditioned on (``None``: the window's
        own start). ``frames``: the start frames in [-1, 1] to condition on instead of ``frames_u8``
        (the model's own imagined frames, as inside a rollout); the target stays the recorded frame.

        Noise levels: a fraction ``p_deterministic`` of the batch is trained on the deterministic path
        (zero noise at ``sigma = 1``), ``p_pure_noise`` at ``sigma = 1`` with noise, the rest
        ``sigma ~ U(0, 1)``.

        Returns:
            dict with ``loss`` (scalar to minimise), ``pixel`` and ``proprio`` (MSE terms).
        """
        self._check_stats()
        frames, target = (to_unit(frames_u8) if frames is None else frames.float()), to_unit(next_frames_u8)
        residual = target - frames
        b = frames.shape[0]
        dev = frames.device
        u = torch.rand(b, generator=generator, device=dev)
        sigma = torch.rand(b, generator=generator, device=dev)
        sigma = torch.where(u < p_deterministic + p_pure_noise, torch.ones_like(sigma), sigma)
        eps = torch.randn(frames.shape, generator=generator, device=dev) * self.noise_scale
        eps = torch.where((u < p_deterministic)[:, None, None, None], torch.zeros_like(eps), eps)
        s = sigma[:, None, None, None]
        z = (1 - s) * residual + s * eps
        cond = self.condition(proprio, actions, next_proprio)
        aligned = None
        if self.anchor_frames:
            aligned = self.aligned_anchor(frames if anchor_u8 is None else to_unit(anchor_u8),
                                          proprio if anchor_proprio is None else anchor_proprio, next_proprio)
        x_hat = self.denoise(z, sigma, frames, cond, aligned)
        pixel = F.mse_loss(x_hat, residual)
        if self.dynamics is not None:   # the dynamics learn from their own windows (dynamics_loss)
            return {"loss": pixel, "pixel": pixel.detach(), "proprio": torch.zeros(())}
        d_target = (next_proprio.float() - proprio.float()) / self.delta_std
        prop = F.mse_loss(self.proprio_delta(frames, cond), d_target)
        return {"loss": pixel + prop, "pixel": pixel.detach(), "proprio": prop.detach()}

    def dynamics_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """The dynamics ensemble's unrolled loss on proprio paths (``ProprioDynamics.loss``: ``proprio``
        ``(B, T + 2, D_s)``, ``actions`` ``(B, T, D_a)``, ``mask`` ``(K, B)``). Raises ``RuntimeError``
        without ``dynamics``."""
        if self.dynamics is None:
            raise RuntimeError("this world model has no dynamics ensemble (dynamics=None)")
        return self.dynamics.loss(batch)
