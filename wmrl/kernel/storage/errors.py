"""Exception classes of :mod:`wmrl.kernel.storage`. All subclass ``ValueError`` so that callers that only
know "bad input" can catch them generically; each message says what is wrong, where (episode, key,
step) and what to change."""

from __future__ import annotations

import os


class StoreError(ValueError):
    """Base class of every EpisodeStore error (missing store, existing store, bad mode, ...)."""


class StoreExistsError(StoreError):
    """:meth:`EpisodeStore.create` found its folder taken (it existed, or another process created it
    first) and was not asked to overwrite it."""


class StoreFormatError(StoreError):
    """The folder is not an EpisodeStore, is corrupt, or has an unknown ``format_version``."""


class EpisodeValidationError(StoreError):
    """An episode given to :meth:`EpisodeStore.append` does not match the store.

    Attributes:
        episode: index the episode would have had in the store (``None`` when unknown).
        key: offending field, e.g. ``"actions"`` or ``"images/agentview"``.
        step: first offending time step, or ``None`` when the whole field is wrong.
    """

    def __init__(self, message: str, *, episode: int | None = None, key: str | None = None,
                 step: int | None = None):
        where = []
        if episode is not None:
            where.append(f"episode {episode}")
        if key is not None:
            where.append(f"key {key!r}")
        if step is not None:
            where.append(f"step {step}")
        prefix = f"[{', '.join(where)}] " if where else ""
        super().__init__(prefix + message)
        self.episode = episode
        self.key = key
        self.step = step


class MissingStatsError(ValueError):
    """Normalisation statistics are required but absent (never silently replaced by identity)."""


class LeRobotFormatError(ValueError):
    """A LeRobot dataset folder cannot be read or written; the message names the folder and why.

    Attributes: ``path`` (the folder, str) and ``reason``."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"LeRobot dataset {self.path}: {reason}")


class DemoImportError(ValueError):
    """A demonstration file (or one episode of it) cannot be imported.

    The message names the file, the episode key (``data/demo_N``) when the problem is specific to
    one episode, the reason, and what to change. Attributes: ``path``, ``demo`` (or ``None``),
    ``reason``.
    """

    def __init__(self, path: str | os.PathLike, reason: str, demo: str | None = None):
        self.path = str(path)
        self.demo = demo
        self.reason = reason
        where = f"{self.path} [data/{demo}]" if demo else self.path
        super().__init__(f"cannot import {where}: {reason}")
