"""A small multi-task vision-language-action policy with a flow-matching action head.

Architecture (sizes for the default config, ``configs/policy/flow_vla.yaml``)::

    agentview  uint8 (B,3,64,64) ─► conv encoder (FiLM by instruction) ─► 128 ┐
    eye_in_hand uint8 (B,3,64,64) ─► conv encoder (FiLM by instruction) ─► 128 ├─► MLP ─► cond (B, 256)
    proprio (B, 9) ─► normalise ─► MLP ─────────────────────────────────► 64  │
    instruction ─► frozen all-MiniLM-L6-v2 (384) ─► Linear ─────────────► 128 ┘
    x_t (B, H, D_a) + t ─► residual MLP, FiLM by cond and t ─► velocity v (B, H, D_a)

* Vision: one conv stack per camera trained from scratch, with feature-wise linear modulation by the
  instruction after every block (FiLM: Perez et al. AAAI 2018; as in RT-1's FiLM-EfficientNet), so
  "lift the red cube" and "lift the green cube" look at different objects. ``encoder.kind:
  torchvision`` swaps in a torchvision backbone (e.g. ``resnet18``) loading weights from a local
  file (``encoder.weights``); nothing is downloaded.
* Language: ``policies.text.encode_instructions`` (frozen, cached per string).
* Action head: flow matching (Lipman et al. 2023; pi0, Black et al. 2024) on the action chunk in
  normalised action space, convention ``x_t = (1-t) x_0 + t eps``, target ``v = eps - x_0``.
* Training (``loss``): each encoded observation is paired with ``train_noise_samples`` independent
  (t, eps) draws ("level-2 minibatching" of Mini-Diffuser, Hu et al. 2025), so the costly image
  encoder runs once per ``M`` flow-matching targets. Random-shift augmentation (DrQ, Kostrikov et al.
  2021) on the images.
* Sampling is delegated to a sampler (``policies.samplers``): the Euler ODE sampler for evaluation,
  the SDE sampler (exact chain log-probs) for GRPO. Swap with ``policy.sampler = SDESampler(...)``.
  Real-time chunking (``sample(..., prefix=, delay=)``): ``policies.rtc`` (Black et al. 2025).
* Networks: ``policies.flow_vla_nets``.
* Output: the sampler's final normalised chunk is unnormalised with the stored statistics
  (``quantile`` or ``mean_std``, buffers saved in the checkpoint) and clipped to the declared action
  space (``wmrl.kernel.types.ActionSpace``; see ``policies.action_space``). Log-probs are of the pre-clip
  normalised chain.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from policies.action_frames import check_space, from_chunk_frame, resolve, to_chunk_frame
from policies.action_space import as_action_space, clip_to_space
from policies.flow_vla_nets import ConvEncoder, TorchvisionEncoder, VelocityHead, random_shift
from policies.rtc import rtc_sample
from policies.samplers import EulerODESampler, check_sample_extras, draw_noise, sample_extras
from policies.text import EMBED_DIM, encode_instructions
from wmrl.kernel.storage import Normalizer, masked_mse
from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND, Obs, PolicySample

# ----------------------------------------------------------------------------- the policy

class FlowVLAPolicy(nn.Module):
    """Multi-task flow-matching VLA policy implementing ``wmrl.kernel.interfaces.Policy``.

    Args:
        cameras: camera names read from ``Obs.images`` (each ``uint8 (B, 3, Hi, Wi)``).
        image_size: ``[Hi, Wi]`` the encoders expect (observations of another size raise).
        state_dim: ``D_s``. action_dim: ``D_a``. chunk_size: ``H``.
        encoder: ``{"kind": "conv", "channels": [...], "out_dim": int}`` or
            ``{"kind": "torchvision", "name": "resnet18", "weights": PATH|None, "out_dim": int}``.
        lang_dim: width of the projected instruction embedding (also the FiLM conditioning input).
        proprio_dim: width of the proprio embedding.
        cond_dim: width of the observation conditioning vector.
        head_width, head_depth, time_dim: velocity head sizes.
        norm_mode: ``"quantile"`` or ``"mean_std"`` for proprio and actions.
        action_space: the ``ActionSpace`` (or its dict / embodiment name) the actions are in.
        sampler: sampler used by ``sample`` (default ``EulerODESampler(10)``); ``log_prob`` needs an
            ``SDESampler``.
        train_noise_samples: ``M`` (t, eps) draws per encoded observation in ``loss``.
        aug_shift: random-shift augmentation in pixels during ``loss`` (0 = off).
        relative_actions: learn and predict each chunk relative to the observed end-effector pose
            (``policies.action_frames``; the 5-D absolute target space only, ``suite=ee``; ``"auto"``:
            exactly there); the
            chunk returned by ``sample`` is in absolute targets either way. Its normalisation
            statistics must then be those of chunk-frame actions (``wmrl train-policy`` does this).

    Raises:
        ValueError: on unknown encoder kinds or inconsistent sizes.
    """

    def __init__(self, cameras: Sequence[str] = (AGENTVIEW, EYE_IN_HAND), image_size: Sequence[int] = (64, 64),
                 state_dim: int = 9, action_dim: int = 7, chunk_size: int = 8,
                 encoder: dict | None = None, lang_dim: int = 128, proprio_dim: int = 64, cond_dim: int = 256,
                 head_width: int = 256, head_depth: int = 3, time_dim: int = 64,
                 norm_mode: str = "quantile", action_space: Any = None, sampler: Any = None,
                 train_noise_samples: int = 8, aug_shift: int = 4, relative_actions: bool | str = False):
        super().__init__()
        encoder = dict(encoder or {"kind": "conv", "channels": [32, 64, 128, 128], "out_dim": 128})
        self.cameras = list(cameras)
        if not self.cameras:
            raise ValueError("FlowVLAPolicy needs at least one camera")
        self.image_size = [int(image_size[0]), int(image_size[1])]
        self.state_dim, self.action_dim, self.chunk_size = int(state_dim), int(action_dim), int(chunk_size)
        self.action_space = as_action_space(action_space)
        if self.action_space.dim != self.action_dim:
            raise ValueError(f"action_space.dim={self.action_space.dim} but action_dim={self.action_dim}")
        self.train_noise_samples = int(train_noise_samples)
        self.aug_shift = int(aug_shift)
        self.sampler = sampler if sampler is not None else EulerODESampler(10)
        self.init_config = dict(
            cameras=self.cameras, image_size=self.image_size, state_dim=self.state_dim,
            action_dim=self.action_dim, chunk_size=self.chunk_size, encoder=encoder, lang_dim=lang_dim,
            proprio_dim=proprio_dim, cond_dim=cond_dim, head_width=head_width, head_depth=head_depth,
            time_dim=time_dim, norm_mode=norm_mode, action_space=self.action_space.to_dict(),
            train_noise_samples=self.train_noise_samples, aug_shift=self.aug_shift)
        self.relative_actions = resolve(relative_actions, self.action_space)
        if self.relative_actions:   # chunks learned and predicted relative to the observed end effector
            check_space(self.action_space)
            self.init_config["relative_actions"] = True

        self.lang_proj = nn.Sequential(nn.Linear(EMBED_DIM, lang_dim), nn.SiLU(), nn.Linear(lang_dim, lang_dim))
        kind = encoder.get("kind", "conv")
        out_dim = int(encoder.get("out_dim", 128))
        if kind == "conv":
            make = lambda: ConvEncoder(self.image_size, encoder.get("channels", [32, 64, 128, 128]), out_dim, lang_dim)  # noqa: E731
        elif kind == "torchvision":
            make = lambda: TorchvisionEncoder(encoder.get("name", "resnet18"), out_dim, lang_dim, encoder.get("weights"))  # noqa: E731
        else:
            raise ValueError(f"encoder.kind must be 'conv' or 'torchvision', got {kind!r}")
        self.encoders = nn.ModuleDict({cam: make() for cam in self.cameras})
        self.proprio_mlp = nn.Sequential(nn.Linear(self.state_dim, proprio_dim), nn.SiLU(),
                                         nn.Linear(proprio_dim, proprio_dim))
        fused = out_dim * len(self.cameras) + proprio_dim + lang_dim
        self.fuse = nn.Sequential(nn.Linear(fused, cond_dim), nn.SiLU(), nn.Linear(cond_dim, cond_dim))
        self.head = VelocityHead(self.chunk_size, self.action_dim, cond_dim, head_width, head_depth, time_dim)
        self.normalizer = Normalizer({"proprio": self.state_dim, "actions": self.action_dim}, mode=norm_mode)

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self.lang_proj[0].weight.device

    def set_norm_stats(self, stats) -> "FlowVLAPolicy":
        """Copy the ``"proprio"`` and ``"actions"`` statistics of a ``wmrl.kernel.storage.NormStats`` (e.g.
        ``store.stats()``) into the buffers (saved in the checkpoint)."""
        self.normalizer.set_stats(stats)
        return self

    def _images(self, images: dict[str, torch.Tensor], augment: bool, generator=None) -> dict[str, torch.Tensor]:
        out = {}
        for cam in self.cameras:
            if cam not in images:
                raise ValueError(f"observation has no camera {cam!r} (has {sorted(images)}); "
                                 f"this policy was built for cameras {self.cameras}")
            img = images[cam]
            if img.dtype != torch.uint8 or img.ndim != 4 or img.shape[1] != 3:
                raise ValueError(f"images[{cam!r}] must be uint8 (B, 3, Hi, Wi), got {img.dtype} {tuple(img.shape)}")
            if list(img.shape[-2:]) != self.image_size:
                raise ValueError(f"images[{cam!r}] are {tuple(img.shape[-2:])} px but the policy expects "
                                 f"{tuple(self.image_size)}; render the cameras at that size")
            x = img.to(self.device, non_blocking=True).float().mul_(2.0 / 255.0).sub_(1.0)
            if augment:
                x = random_shift(x, self.aug_shift, generator)
            out[cam] = x
        return out

    def encode(self, images: dict[str, torch.Tensor], proprio: torch.Tensor, tasks: list[str],
               augment: bool = False) -> torch.Tensor:
        """Observation conditioning ``float32 (B, cond_dim)``.

        Args:
            images: camera -> ``uint8 (B, 3, Hi, Wi)``. proprio: raw ``(B, D_s)``. tasks: ``B`` strings.
        """
        lang = self.lang_proj(encode_instructions(list(tasks)).to(self.device))
        ims = self._images(images, augment)
        if proprio.shape[-1] != self.state_dim:
            raise ValueError(f"proprio has D_s={proprio.shape[-1]}, the policy expects {self.state_dim}")
        feats = [self.encoders[cam](ims[cam], lang) for cam in self.cameras]
        feats.append(self.proprio_mlp(self.normalizer.normalize("proprio", proprio.to(self.device).float())))
        feats.append(lang)
        return self.fuse(torch.cat(feats, dim=-1))

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """``v(x_t, t | obs)``: ``x (B, H, D_a)``, ``t (B,)``, ``cond (B, C)`` -> ``(B, H, D_a)``."""
        return self.head(x, t, cond)

    # ------------------------------------------------------------------ training
    def loss(self, batch: dict, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
        """Flow-matching BC loss on a batch of windows (``wmrl.kernel.storage.WindowDataset`` items, collated).

        Args:
            batch: ``images[cam]`` ``uint8 (B, n_obs, 3, Hi, Wi)`` or ``(B, 3, Hi, Wi)`` (the last
                observation is used), ``proprio`` ``(B, n_obs, D_s)`` or ``(B, D_s)``, ``actions``
                ``(B, H', D_a)`` with ``H' >= H``, ``action_pad`` ``bool (B, H')`` (True = padded,
                excluded from the loss), ``instruction``: ``B`` strings.

        Returns:
            (scalar loss, dict of float metrics).
        """
        images = {c: (v[:, -1] if v.ndim == 5 else v) for c, v in batch["images"].items()}
        proprio = batch["proprio"]
        proprio = proprio[:, -1] if proprio.ndim == 3 else proprio
        actions = batch["actions"][:, : self.chunk_size].to(self.device).float()
        pad = batch.get("action_pad")
        pad = pad[:, : self.chunk_size].to(self.device).bool() if pad is not None \
            else torch.zeros(actions.shape[:2], dtype=torch.bool, device=self.device)
        if actions.shape[1] != self.chunk_size:
            raise ValueError(f"batch has {actions.shape[1]} actions per window, the policy needs {self.chunk_size}")
        cond = self.encode(images, proprio, list(batch["instruction"]), augment=self.training)
        if self.relative_actions:
            actions = to_chunk_frame(actions, proprio.to(self.device).float())
        m = max(1, self.train_noise_samples)
        x0 = self.normalizer.normalize("actions", actions).repeat_interleave(m, 0)
        cond = cond.repeat_interleave(m, 0)
        pad = pad.repeat_interleave(m, 0)
        b = x0.shape[0]
        # pi0 / LeRobot time sampling: Beta(1.5, 1) scaled to [0.001, 1) (more weight on noisy t)
        gdev = generator.device if generator is not None else self.device
        u = torch.rand(b, generator=generator, device=gdev).to(self.device)
        t = 0.001 + 0.999 * u.pow(1.0 / 1.5)
        eps = torch.randn(x0.shape, generator=generator, device=gdev).to(self.device)
        xt, target = flow_pair(x0, t, eps)
        v = self.velocity(xt, t, cond)
        loss = masked_mse(v, target, pad)  # padded steps (past the episode end) are left out
        return loss, {"loss": float(loss.detach())}

    # ------------------------------------------------------------------ Policy protocol
    def _velocity_fn(self, obs: Obs):
        obs.validate()
        cond = self.encode(obs.images, obs.proprio, obs.task)
        return lambda x, t: self.velocity(x, t, cond)

    supports_rtc = True
    rtc_beta = 5.0  # RTC guidance-weight cap (``policies.rtc``); set by the composition root (serve.yaml)

    def sample(self, obs: Obs, generator: torch.Generator | None = None, prefix: torch.Tensor | None = None,
               delay: int = 0) -> PolicySample:
        """Sample an action chunk with ``self.sampler``, or with real-time chunking when ``prefix`` is given.

        Args:
            obs: batch ``B``. generator: all noise is drawn from it.
            prefix: committed actions ``float32 (P, D_a)`` in controller units (``P = 0`` allowed):
                the chunk is sampled by ``policies.rtc.rtc_sample`` (Euler, the sampler's
                ``num_steps`` and, for ``EulerODESampler``, its ``noise_scale``; guidance cap
                :attr:`rtc_beta`) so that it continues the prefix; ``None``: plain sampling.
            delay: ``d``, prefix actions that will have run before the chunk arrives (frozen).

        Returns ``PolicySample`` with ``actions`` ``float32 (B, H, D_a)`` unnormalised and clipped to the
        action space, ``log_prob`` ``(B,)`` (0 for the ODE sampler and for RTC) and, for the SDE sampler,
        ``extras["chain"]`` ``(B, K+1, H, D_a)`` (normalised, pre-clip) and ``extras["noise_level"]`` ``(B,)``.
        """
        if prefix is not None:
            return self._sample_rtc(obs, generator, prefix, int(delay))
        with torch.no_grad():
            vf = self._velocity_fn(obs)
            out = self.sampler.sample(vf, (obs.batch_size, self.chunk_size, self.action_dim), generator, self.device)
            actions = clip_to_space(self._absolute(self.normalizer.unnormalize("actions", out.x0), obs), self.action_space).float()
        extras = sample_extras(self.sampler, out, obs.batch_size, self.device)
        return PolicySample(actions=actions, log_prob=out.log_prob.float(), extras=extras)

    def _sample_rtc(self, obs: Obs, generator, prefix: torch.Tensor, delay: int) -> PolicySample:
        with torch.no_grad():  # encode the observation once, without a graph through the encoder
            vf = self._velocity_fn(obs)
        y = prefix.to(self.device).float()
        if self.relative_actions:
            y = to_chunk_frame(y[None], obs.proprio[:1].to(self.device).float())[0]
        y = self.normalizer.normalize("actions", y)
        # the sampling temperature of the policy's own sampler (e.g. noise_scale=0: from the prior
        # mean, as the VLA is evaluated); RTC then only adds the prefix guidance
        scale = self.sampler.noise_scale if isinstance(self.sampler, EulerODESampler) else 1.0
        noise = draw_noise((obs.batch_size, self.chunk_size, self.action_dim), generator, self.device, torch.float32) * scale
        x = rtc_sample(vf, noise, y, delay, num_steps=int(self.sampler.num_steps), beta=float(self.rtc_beta))
        actions = clip_to_space(self._absolute(self.normalizer.unnormalize("actions", x), obs), self.action_space).float()
        return PolicySample(actions=actions, log_prob=torch.zeros(obs.batch_size, device=self.device))

    def _absolute(self, actions: torch.Tensor, obs: Obs) -> torch.Tensor:
        """Unnormalised chunk -> controller units: with ``relative_actions``, the observed pose added back."""
        if not self.relative_actions:
            return actions
        return from_chunk_frame(actions, obs.proprio.to(actions.device).float())

    def log_prob(self, obs: Obs, sample: PolicySample, per_step: bool = False) -> torch.Tensor:
        """Differentiable ``float32 (B,)`` log-density of ``sample.extras["chain"]`` under the current
        parameters (see ``policies.samplers.SDESampler``); ``per_step=True``: the sampler's ``m``
        stochastic denoising transitions' log-densities ``float32 (B, m)`` (``m = K`` by default).
        Raises ``ValueError`` if the policy's sampler is not stochastic, the sample has no chain, or it
        was drawn with another noise level or number of stochastic steps."""
        if not self.sampler.stochastic:
            raise ValueError("log_prob needs a stochastic sampler: set policy.sampler = "
                             "policies.samplers.SDESampler(num_steps, noise_level) before sampling")
        chain = sample.extras.get("chain")
        if chain is None:
            raise ValueError("sample has no extras['chain']; it was not drawn with an SDE sampler")
        check_sample_extras(self.sampler, sample.extras)
        vf = self._velocity_fn(obs)
        return self.sampler.log_prob(vf, chain.to(self.device), per_step=per_step)

    def flow_matching_loss(self, obs: Obs, sample: PolicySample, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """Per-sample conditional flow-matching loss of the sampled chunk, differentiable in the network:
        the quantity whose change FPO turns into a likelihood-ratio estimate (McAllister et al. 2025,
        "Flow Matching Policy Gradients", arXiv 2507.21053, eq. 8-9: ``log r ~ L_old - L_new``).

        Args:
            obs: batch ``B`` of the observations the chunks were sampled from.
            sample: the ``PolicySample``; its recorded chain's end ``extras["chain"][:, -1]`` is the
                normalised, pre-clip chunk ``x_0`` ``float32 (B, H, D_a)``.
            t: ``float32 (B, N)`` flow times in ``(0, 1]``; eps: ``float32 (B, N, H, D_a)`` noise draws
                (the same draws must be used for the old and the new parameters).

        Returns ``float32 (B,)``: ``mean_n sum_{H, D_a} ||v(x_t, t) - (eps - x_0)||^2`` with
        ``x_t = (1 - t) x_0 + t eps``. Raises ``ValueError`` when the sample has no chain (draw it with a
        sampler that records one, e.g. ``SDESampler``) or the draws do not fit it.
        """
        chain = sample.extras.get("chain")
        if chain is None:
            raise ValueError("flow_matching_loss needs sample.extras['chain'] (sample with policies.samplers.SDESampler)")
        x0 = chain[:, -1].to(self.device).float()
        if t.ndim != 2 or t.shape[0] != x0.shape[0] or eps.shape != (x0.shape[0], t.shape[1], *x0.shape[1:]):
            raise ValueError(f"t {tuple(t.shape)} / eps {tuple(eps.shape)} do not fit chunks {tuple(x0.shape)}: "
                             "expected (B, N) and (B, N, H, D_a)")
        vf = self._velocity_fn(obs)
        losses = []
        for j in range(t.shape[1]):
            tj, ej = t[:, j].to(self.device), eps[:, j].to(self.device)
            xt, target = flow_pair(x0, tj, ej)
            losses.append((vf(xt, tj) - target).pow(2).flatten(1).sum(1))
        return torch.stack(losses, 1).mean(1)


def flow_pair(x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flow-matching training pair of the policy's convention (rectified flow, Liu et al. 2023;
    Lipman et al. 2023; pi0 / LeRobot): ``x_t = (1 - t) x_0 + t eps`` and the velocity target
    ``eps - x_0`` (``t = 1`` is pure noise, ``t = 0`` the action chunk).

    Args: x0, eps: ``float32 (B, H, D_a)`` normalised action chunks and noise; t: ``float32 (B,)`` in [0, 1].
    Returns: ``(x_t, target)``, both ``float32 (B, H, D_a)``.
    """
    return (1 - t)[:, None, None] * x0 + t[:, None, None] * eps, eps - x0

