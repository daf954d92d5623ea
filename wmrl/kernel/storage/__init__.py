"""Episode storage: the zarr v3 :class:`EpisodeStore`, normalisation statistics, training windows.

Modules: ``episode_store.py`` (the store class) with ``store_layout.py`` (format, metadata schema,
index file, window indices), ``store_validation.py`` (episode checks) and ``store_writer.py``
(crash-safe writes); ``dataset.py`` (windows as a torch Dataset, masked loss); ``normalize.py``;
``errors.py`` (every exception class).

Import/export of robomimic ``demo.hdf5`` and LeRobotDataset v3 live in ``wmrl.kernel.storage.robomimic``
(conversion; inspection in ``robomimic_inspect.py``, MJCF repair in ``robomimic_mjcf.py``) and
``wmrl.kernel.storage.lerobot_io`` (import; export in ``lerobot_export.py``, shared schema in
``lerobot_schema.py``). Those modules import ``lerobot`` / ``h5py`` / ``mujoco`` lazily and are not
imported here.
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
