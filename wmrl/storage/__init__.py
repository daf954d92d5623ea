"""Episode storage: the zarr v3 :class:`EpisodeStore`, normalisation statistics, training windows.

Import/export of robomimic ``demo.hdf5`` and LeRobotDataset v3 live in ``wmrl.storage.robomimic``
and ``wmrl.storage.lerobot_io``.
"""

from wmrl.storage.dataset import WindowDataset, masked_mean, masked_mse
from wmrl.storage.episode_store import FORMAT_VERSION, EpisodeStore, window_indices
from wmrl.storage.errors import (
    EpisodeValidationError,
    MissingStatsError,
    StoreError,
    StoreExistsError,
    StoreFormatError,
)
from wmrl.storage.normalize import NormStats, Normalizer

__all__ = [
    "EpisodeStore",
    "EpisodeValidationError",
    "FORMAT_VERSION",
    "MissingStatsError",
    "NormStats",
    "Normalizer",
    "StoreError",
    "StoreExistsError",
    "StoreFormatError",
    "WindowDataset",
    "masked_mean",
    "masked_mse",
    "window_indices",
]
