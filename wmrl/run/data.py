"""Data loading shared by the world-model and critic entry points (``wmrl train-worldmodel``,
``wmrl train-critic``, ``wmrl evaluate-worldmodel``); a non-entry module, so those entry points do
not import each other."""

from __future__ import annotations


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
