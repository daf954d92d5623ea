"""LeRobot flow-matching VLAs (SmolVLA, pi0, pi0.5) behind the ``wmrl.kernel.interfaces.Policy`` protocol,
with exact chain log-probabilities through this project's samplers.

How it works
------------
Compatibility shims for lerobot 0.6.1 with the installed transformers 5 (both small, documented at
their functions): SmolVLA's KV-cache ``crop`` (:func:`_legacy_crop`) and pi0/pi0.5's
``create_causal_mask`` call (:func:`install_transformers5_compat`).

LeRobot's flow policies (lerobot 0.6.1: ``SmolVLAPolicy``, ``PI0Policy``, ``PI05Policy``) all encode
the observation prefix once (VLM over images + language (+ state), giving a KV cache) and then call
``lerobot.policies.common.flow_matching.euler_integrate(denoise_fn, noise, num_steps)`` where
``denoise_fn(x_t, t)`` runs the action expert and returns the velocity. Their flow convention is the
one of ``policies.samplers`` (``x_t = t * noise + (1 - t) * actions``, integrate ``t: 1 -> 0``).

:func:`capture_velocity_fn` runs the policy's own ``predict_action_chunk`` with ``euler_integrate``
replaced (only in the policy's modeling module and only for that call) by a function that returns the
``denoise_fn`` closure instead of integrating. That closure *is* the policy's action-expert velocity
field for this observation, with the prefix already encoded; our samplers then integrate it:
``EulerODESampler`` (evaluation) or ``SDESampler`` (GRPO, exact Gaussian-transition log-probs, as in
Flow-GRPO / pi_RL). All prefix preprocessing stays LeRobot's own code.

Gradients: LeRobot encodes the prefix under ``torch.no_grad`` (its ``predict_action_chunk`` is
decorated), so ``log_prob`` is differentiable in the action expert and the action/state/time
projections, with the VLM prefix (KV cache) treated as constant: RL fine-tunes the action expert, as
with SmolVLA's ``train_expert_only``.

The chain covers LeRobot's whole padded chunk ``(B, K+1, chunk_size, max_action_dim)``, so the
log-prob is exact for what is sampled; the returned actions are its first ``H = n_action_steps``
steps and ``D_a`` dims, unnormalised with the statistics held by this adapter (``NormStats`` of the
training store, as buffers) and clipped to the declared action space.

Observation mapping: ``Obs.images[cam]`` (uint8) -> ``batch[camera_map[cam]]`` float in [0, 1];
``Obs.proprio`` -> normalised -> ``observation.state``; ``Obs.task`` -> prompt (``"plain"``: task +
newline, as LeRobot's SmolVLA / pi0 processors; ``"pi05"``: ``"Task: ..., State: <256-bin state>;\\nAction: "``
as ``Pi05PrepareStateTokenizerProcessorStep``) -> tokenizer -> ``observation.language.tokens`` /
``attention_mask``.

Offline tiny builders for tests (``tiny_smolvla``, ``tiny_pi0``, ``tiny_pi05``) live in
``policies.lerobot_tiny`` and are re-exported here. Pretrained weights on a GPU machine: see
``policies/README.md``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from policies.action_space import as_action_space, clip_to_space
from policies.samplers import EulerODESampler, check_sample_extras, sample_extras
from wmrl.kernel.storage import Normalizer
from wmrl.kernel.types import Obs, PolicySample

OBS_STATE = "observation.state"
OBS_LANGUAGE_TOKENS = "observation.language.tokens"
OBS_LANGUAGE_ATTENTION_MASK = "observation.language.attention_mask"


@contextlib.contextmanager
def _patched_euler_integrate(module_name: str, store: dict):
    mod = sys.modules[module_name]
    if not hasattr(mod, "euler_integrate"):
        raise TypeError(f"{module_name} has no euler_integrate: this LeRobot policy is not a supported flow policy "
                        "(supported: SmolVLA, pi0, pi0.5 of lerobot 0.6.1)")
    original = mod.euler_integrate

    def capture(denoise_fn, noise, num_steps, **kwargs):
        store["fn"] = denoise_fn
        store["noise_shape"] = tuple(noise.shape)
        return noise

    mod.euler_integrate = capture
    try:
        yield
    finally:
        mod.euler_integrate = original


def _legacy_crop(cache, max_length: int) -> None:
    """``DynamicCache.crop`` with LeRobot 0.6.1's meaning (keep the first ``max_length`` tokens).

    transformers 5 rejects a positive argument (it now means "tokens to remove", negative), which
    makes SmolVLA's ``denoise_step`` raise at its ``past_key_values.crop(prefix_len)``."""
    for layer in cache.layers:  # per layer: SmolVLA's cross-attention layers never grow
        keys = getattr(layer, "keys", None)
        if keys is None or not getattr(layer, "is_initialized", True):
            continue
        extra = int(keys.shape[-2]) - int(max_length)
        if extra > 0:
            layer.crop(-extra)


def _fix_cache_crop(fn: Callable) -> None:
    """Give every ``DynamicCache`` captured by ``fn``'s closure the legacy ``crop`` (see above)."""
    try:
        from transformers import DynamicCache
    except ImportError:  # pragma: no cover
        return
    import types

    for cell in fn.__closure__ or ():
        try:
            obj = cell.cell_contents
        except ValueError:
            continue
        if isinstance(obj, DynamicCache):
            obj.crop = types.MethodType(_legacy_crop, obj)


def capture_velocity_fn(lerobot_policy, batch: dict) -> tuple[Callable, tuple[int, ...]]:
    """The velocity field ``v(x_t (B, chunk, max_action_dim), t (B,))`` of a LeRobot flow policy for
    ``batch`` (its prefix encoded once), and the shape of its action noise."""
    inner = getattr(lerobot_policy, "model", None)
    if inner is None:
        raise TypeError(f"{type(lerobot_policy).__name__} has no .model flow network")
    store: dict = {}
    if hasattr(lerobot_policy, "reset"):
        lerobot_policy.reset()  # empty its observation queues: one observation per call
    with _patched_euler_integrate(type(inner).__module__, store):
        lerobot_policy.predict_action_chunk(dict(batch))
    if "fn" not in store:
        raise RuntimeError(f"{type(lerobot_policy).__name__}.predict_action_chunk did not reach euler_integrate")
    _fix_cache_crop(store["fn"])
    return store["fn"], store["noise_shape"]


def install_transformers5_compat() -> bool:
    """Make LeRobot 0.6.1's pi0 / pi0.5 Gemma forward run with transformers 5 (idempotent).

    ``lerobot/policies/pi_gemma.py`` calls ``create_causal_mask(..., cache_position=...,
    past_key_values=...)``; transformers 5 renamed ``past_key_values`` to ``cache`` and dropped
    ``cache_position`` (TypeError inside LeRobot's own ``predict_action_chunk``). This replaces the
    name in ``pi_gemma``'s namespace by a wrapper that maps the arguments. Returns True if installed.
    """
    import inspect

    try:
        import lerobot.policies.pi_gemma as pg
        from transformers import masking_utils
    except ImportError:  # pragma: no cover
        return False
    fn = masking_utils.create_causal_mask
    if getattr(pg.create_causal_mask, "_wmrl_compat", False) or "cache_position" in inspect.signature(fn).parameters:
        return False

    def create_causal_mask(config, inputs_embeds, attention_mask, cache_position=None, past_key_values=None,
                           position_ids=None, **kw):
        return fn(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=past_key_values,
                  position_ids=position_ids, **kw)

    create_causal_mask._wmrl_compat = True
    pg.create_causal_mask = create_causal_mask
    return True


class LeRobotFlowPolicy(nn.Module):
    """A LeRobot flow VLA as a ``wmrl`` Policy (see the module docstring).

    Args:
        lerobot_policy: a ``SmolVLAPolicy``, ``PI0Policy`` or ``PI05Policy`` (built or ``from_pretrained``).
        tokenizer: a Hugging Face tokenizer (its ``__call__`` gives ``input_ids`` / ``attention_mask``).
        camera_map: our camera name -> LeRobot image feature key (e.g. ``{"agentview":
            "observation.images.image"}``).
        state_dim, action_dim: ``D_s``, ``D_a`` of this project's data.
        chunk_size: ``H`` actions returned per call (default: the policy's ``n_action_steps``).
        prompt: ``"plain"`` or ``"pi05"``.
        norm_mode: normalisation of state and actions (LeRobot's SmolVLA/pi0 use mean_std, pi0.5 quantile).
        action_space: the action space of the actions (clip range, gripper convention).
        sampler: ``EulerODESampler`` (default, ``num_steps`` from the policy config) or ``SDESampler``.
        tokenizer_max_length: padding length of the prompt (default: the policy config's).

    ``supports_rtc`` is ``False``: LeRobot's prefix-guided sampling is not wired through the adapter.
    ``sampler`` is any of ``policies.samplers`` (each declares ``stochastic``).
    """

    supports_rtc = False  # no real-time chunking (wmrl.kernel.interfaces.Policy)

    def __init__(self, lerobot_policy: nn.Module, tokenizer: Any, camera_map: dict[str, str],
                 state_dim: int = 9, action_dim: int = 7, chunk_size: int | None = None, prompt: str = "plain",
                 norm_mode: str = "mean_std", action_space: Any = None, sampler: Any = None,
                 tokenizer_max_length: int | None = None):
        super().__init__()
        cfg = lerobot_policy.config
        if type(lerobot_policy).__module__.split(".")[-2:-1] in (["pi0"], ["pi05"]):
            install_transformers5_compat()
        self.lerobot_policy = lerobot_policy
        self.tokenizer = tokenizer
        self.camera_map = dict(camera_map)
        for key in self.camera_map.values():
            if key not in cfg.image_features:
                raise ValueError(f"camera_map target {key!r} is not an image feature of the policy "
                                 f"({list(cfg.image_features)})")
        self.state_dim, self.action_dim = int(state_dim), int(action_dim)
        self.chunk_size = int(chunk_size or cfg.n_action_steps)
        if self.chunk_size > cfg.chunk_size:
            raise ValueError(f"chunk_size {self.chunk_size} exceeds the policy's chunk_size {cfg.chunk_size}")
        if self.action_dim > cfg.max_action_dim or self.state_dim > cfg.max_state_dim:
            raise ValueError(f"dims (state {state_dim}, action {action_dim}) exceed the policy's max dims "
                             f"({cfg.max_state_dim}, {cfg.max_action_dim})")
        if prompt not in ("plain", "pi05"):
            raise ValueError(f"prompt must be 'plain' or 'pi05', got {prompt!r}")
        self.prompt = prompt
        self.max_length = int(tokenizer_max_length or cfg.tokenizer_max_length)
        self.action_space = as_action_space(action_space)
        self.normalizer = Normalizer({"proprio": self.state_dim, "actions": self.action_dim}, mode=norm_mode)
        k = getattr(cfg, "num_steps", None) or getattr(cfg, "num_inference_steps", 10)
        self.sampler = sampler if sampler is not None else EulerODESampler(int(k))

    @property
    def device(self) -> torch.device:
        return next(self.lerobot_policy.parameters()).device

    def set_norm_stats(self, stats) -> "LeRobotFlowPolicy":
        """Statistics of ``"proprio"`` and ``"actions"`` (``wmrl.kernel.storage.NormStats``)."""
        self.normalizer.set_stats(stats)
        return self

    # ------------------------------------------------------------------ observation -> LeRobot batch
    def _prompts(self, tasks: Sequence[str], state_norm: torch.Tensor) -> list[str]:
        if self.prompt == "plain":
            return [t if t.endswith("\n") else t + "\n" for t in tasks]
        max_state = self.lerobot_policy.config.max_state_dim
        s = torch.zeros(state_norm.shape[0], max_state)
        s[:, : state_norm.shape[1]] = state_norm.detach().cpu().clamp(-1, 1)
        bins = np.digitize(s.numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        return [f"Task: {t.strip().replace('_', ' ').replace(chr(10), ' ')}, State: {' '.join(map(str, b))};\nAction: "
                for t, b in zip(tasks, bins)]

    def lerobot_batch(self, obs: Obs) -> dict:
        """The LeRobot input batch for ``obs`` (images in [0, 1], normalised state, prompt tokens)."""
        obs.validate()
        dev = self.device
        batch = {}
        for cam, key in self.camera_map.items():
            if cam not in obs.images:
                raise ValueError(f"observation has no camera {cam!r} (has {sorted(obs.images)})")
            batch[key] = obs.images[cam].to(dev).float() / 255.0
        if obs.proprio.shape[-1] != self.state_dim:
            raise ValueError(f"proprio has D_s={obs.proprio.shape[-1]}, the adapter expects {self.state_dim}")
        state = self.normalizer.normalize("proprio", obs.proprio.to(dev).float())
        batch[OBS_STATE] = state
        tok = self.tokenizer(self._prompts(obs.task, state), padding="max_length", max_length=self.max_length,
                             truncation=True, return_tensors="pt")
        batch[OBS_LANGUAGE_TOKENS] = tok["input_ids"].to(dev)
        batch[OBS_LANGUAGE_ATTENTION_MASK] = tok["attention_mask"].to(dev).bool()
        return batch

    # ------------------------------------------------------------------ Policy protocol
    def _velocity(self, obs: Obs):
        fn, shape = capture_velocity_fn(self.lerobot_policy, self.lerobot_batch(obs))
        return (lambda x, t: fn(x, t).float()), shape

    def sample(self, obs: Obs, generator: torch.Generator | None = None) -> PolicySample:
        """``PolicySample``: actions ``float32 (B, H, D_a)``; for the SDE sampler ``extras["chain"]``
        ``(B, K+1, chunk, max_action_dim)`` and ``extras["noise_level"]``."""
        with torch.no_grad():
            vf, shape = self._velocity(obs)
            out = self.sampler.sample(vf, shape, generator, self.device)
            x0 = out.x0[:, : self.chunk_size, : self.action_dim]
            actions = clip_to_space(self.normalizer.unnormalize("actions", x0), self.action_space).float()
        extras = sample_extras(self.sampler, out, obs.batch_size, self.device)
        return PolicySample(actions=actions, log_prob=out.log_prob.float(), extras=extras)

    def log_prob(self, obs: Obs, sample: PolicySample, per_step: bool = False) -> torch.Tensor:
        """Differentiable ``float32 (B,)`` log-density of ``sample.extras["chain"]`` (SDE sampler);
        ``per_step=True``: per denoising transition, ``float32 (B, K)``."""
        if not self.sampler.stochastic:
            raise ValueError("log_prob needs a stochastic sampler: set adapter.sampler = SDESampler(...)")
        chain = sample.extras.get("chain")
        if chain is None:
            raise ValueError("sample has no extras['chain']; it was not drawn with an SDE sampler")
        check_sample_extras(self.sampler, sample.extras)
        vf, _ = self._velocity(obs)
        return self.sampler.log_prob(vf, chain.to(self.device), per_step=per_step)


_TINY = ("tiny_smolvla", "tiny_pi0", "tiny_pi05", "write_tiny_smolvlm", "local_tokenizer")


def __getattr__(name):
    """The tiny offline builders, from ``policies.lerobot_tiny`` (imported on first use: it imports this module)."""
    if name in _TINY:
        from policies import lerobot_tiny

        return getattr(lerobot_tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
