"""Episode storage: the zarr v3 :class:`EpisodeStore`, normalisation statistics, training windows.

Import/export of robomimic ``demo.hdf5`` and LeRobotDataset v3 live in ``wmrl.kernel.storage.robomimic``
and ``wmrl.kernel.storage.lerobot_io``.
"""

from wmrl.kernel.storage.dataset import WindowDataset, masked_mse
from wmrl.kernel.storage.episode_store import (
    FORMAT_VERSION,
    EpisodeStore,
    window_indices,
)
from wmrl.kernel.storage.errors import (
    EpisodeValidationError,
    MissingStatsError,
    StoreError,
    StoreExistsError,
    StoreFormatError,
)
from wmrl.kernel.storage.normalize import Normalizer, NormStats

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
    "masked_mse",
    "window_indices",
]
