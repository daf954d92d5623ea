"""Data loading shared by the world-model and critic entry points (``wmrl train-worldmodel``,
``wmrl train-critic``, ``wmrl evaluate-worldmodel``); a non-entry module, so those entry points do
not import each other."""

from __future__ import annotations

from pathlib import Path


def load_splits(store_path, heldout_every: int, cameras):
    """``(train, heldout, store)``: ``worldmodels.data.EpisodeFrames`` of an EpisodeStore split by
    episode index (``worldmodels.data.heldout_episodes``) and the open store.

    Raises:
        ValueError: the store lacks one of ``cameras``.
    """
    from wmrl.kernel.storage import EpisodeStore
    from worldmodels.data import EpisodeFrames, heldout_episodes

    store = EpisodeStore.open(store_path, mode="r")
    missing = [c for c in cameras if c not in store.cameras]
    if missing:
        raise ValueError(f"the model wants cameras {missing} that the store {store_path} lacks "
                         f"(it has {list(store.cameras)}); set worldmodel.cameras / critic.cameras")
    tr, ho = heldout_episodes(len(store), int(heldout_every))
    return EpisodeFrames.from_store(store, tr, cameras), EpisodeFrames.from_store(store, ho, cameras), store


def check_image_size(model_size, data) -> None:
    """Raise ``ValueError`` when the config's ``image_size`` (int or ``(H, W)``) differs from the
    images of ``data`` (``data.image_size``)."""
    size = tuple(model_size) if not isinstance(model_size, int) else (model_size, model_size)
    if size != data.image_size:
        raise ValueError(f"the store's images are {data.image_size}, the config says image_size={size}; "
                         "set image_size to match")


def model_and_splits(section, ctx, cfg):
    """``(constructor config, model, train, heldout, store)`` for ``wmrl train-worldmodel`` /
    ``train-critic``: the ``section`` config (``cfg.worldmodel`` / ``cfg.critic``) resolved, the data of
    ``cfg.store`` split every ``cfg.heldout_every`` episodes, its image size checked, the model built.

    Raises:
        ValueError: missing cameras or an image size that differs from the store's.
    """
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    model_cfg = OmegaConf.to_container(section, resolve=True)
    train, held, store = load_splits(ctx.path(cfg.store), cfg.heldout_every, model_cfg["cameras"])
    check_image_size(model_cfg["image_size"], train)
    fill_action_space(model_cfg, store)
    return model_cfg, instantiate(model_cfg, _convert_="all"), train, held, store


def fill_action_space(model_cfg: dict, store) -> None:
    """Fill an action-conditioned model's ``action_dim`` / ``action_low`` / ``action_high`` (when the
    config has them and they are ``None``) from the store's ``ActionSpace``, in place.

    Raises:
        ValueError: a configured ``action_dim`` that differs from the store's.
    """
    if "action_dim" not in model_cfg:
        return
    space = store.action_space
    if model_cfg["action_dim"] is None:
        model_cfg["action_dim"] = int(store.action_dim)
    if int(model_cfg["action_dim"]) != int(store.action_dim):
        raise ValueError(f"the model's action_dim={model_cfg['action_dim']} differs from the store's {store.action_dim} "
                         f"({space.controller} {space.mode}); set action_dim=null to take the store's")
    for key, bound in (("action_low", space.low), ("action_high", space.high)):
        if key in model_cfg and model_cfg[key] is None:
            model_cfg[key] = [float(v) for v in bound] if isinstance(bound, (tuple, list)) else float(bound)
    dyn = model_cfg.get("dynamics")
    if isinstance(dyn, dict) and dyn.get("action_space") is None:
        dyn["action_space"] = space.to_dict()


def merge_stores(sources: list[Path], dest: Path, source: str = "pipeline") -> dict:
    """Copy every episode of ``sources`` (EpisodeStores with the same cameras/dims) into a new store."""
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.refresh import store_like

    out = store_like(EpisodeStore.open(sources[0], "r"), dest, source)
    n = 0
    for p in sources:
        st = EpisodeStore.open(p, "r")
        for i in range(len(st)):
            out.append(st.episode(i))
            n += 1
    return {"episodes": n, "path": str(dest)}
