"""Checkpoints as folders, without pickle.

A checkpoint folder holds

* ``config.yaml``: ``_target_`` (import path of the object's class) plus its constructor
  arguments, so :func:`load_checkpoint` rebuilds it with ``hydra.utils.instantiate``;
* ``model.safetensors``: the ``state_dict`` (parameters and buffers, e.g. normalisation
  statistics held by a :class:`wmrl.kernel.storage.Normalizer`);
* optionally ``extra.safetensors`` (any named tensors, e.g. optimizer state, see
  :func:`optimizer_state_to_tensors`) and ``meta.json`` (JSON, e.g. the training step).

Writes are atomic at the folder level: everything goes into a temporary sibling folder, then
``checksums.json`` (sha256 of every weight file, ``*.safetensors``; the YAML and JSON stay
editable by hand) is written last, and the folder replaces
``folder`` in one step: a rename when ``folder`` does not exist, an atomic exchange of the two
folders (Linux ``renameat2(RENAME_EXCHANGE)``) when it does, so a kill at any moment leaves either
the old or the new checkpoint complete under its name. Where the exchange is not supported (another
OS or file system) the old folder is moved aside first; a kill between the two renames leaves no
``folder``, and :func:`recover_checkpoint` (run by every save and load, and by
:func:`checkpoint_exists`) puts back the newest complete one. Leftover temporary folders of dead
writers are removed. Loading checks the sha256 of each weight file against ``checksums.json`` and refuses
a changed one, naming it; a checkpoint written before checksums existed loads with a log note.

Errors: :class:`CheckpointError` (a ``ValueError``) for a missing or corrupt folder, a config
without ``_target_``, an object that cannot be rebuilt, or weights that do not fit it (strict).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from wmrl.kernel.leftovers import dead_writer_leftovers

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
EXTRA_FILE = "extra.safetensors"
META_FILE = "meta.json"
CHECKSUM_FILE = "checksums.json"

log = logging.getLogger("wmrl.kernel.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint folder is missing, corrupt, or does not fit the object it describes."""


def _config_dict(obj: Any, config: Any) -> dict:
    if config is None:
        raise CheckpointError(f"save_checkpoint needs the constructor arguments of {type(obj).__name__} "
                              "as `config` (a dict, DictConfig or dataclass)")
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise CheckpointError(f"config must be a mapping of constructor arguments, got {type(config).__name__}")
    config = dict(config)
    cls = type(obj)
    config.setdefault("_target_", f"{cls.__module__}.{cls.__qualname__}")
    return config


def save_checkpoint(obj: nn.Module, folder: str | os.PathLike, config: Any,
                    extra_tensors: Mapping[str, torch.Tensor] | None = None,
                    meta: Mapping[str, Any] | None = None) -> Path:
    """Write ``obj`` to the checkpoint folder ``folder`` (replacing it atomically if it exists).

    Args:
        obj: the ``nn.Module`` to save.
        folder: destination folder.
        config: constructor arguments of ``obj`` (dict / DictConfig / dataclass); ``_target_`` is
            added as ``obj``'s class path unless given. Values must be YAML-able (numbers, strings,
            lists, dicts, nested ``_target_`` configs).
        extra_tensors: optional named tensors saved to ``extra.safetensors``.
        meta: optional JSON-serialisable dict saved to ``meta.json``.

    Returns the folder path. Raises :class:`CheckpointError` for a config that cannot be written.
    """
    from safetensors.torch import save_file, save_model

    if not isinstance(obj, nn.Module):
        raise CheckpointError(f"save_checkpoint saves nn.Module objects, got {type(obj).__name__}")
    cfg = _config_dict(obj, config)
    try:
        yaml_text = OmegaConf.to_yaml(OmegaConf.create(cfg))
    except Exception as e:  # noqa: BLE001 - omegaconf raises several types for unsupported values
        raise CheckpointError(f"config of {type(obj).__name__} is not YAML-serialisable: {e}") from None
    meta_text = None
    if meta is not None:
        try:
            meta_text = json.dumps(dict(meta), indent=2)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint meta is not JSON-serialisable: {e}") from None
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    recover_checkpoint(folder)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        (tmp / CONFIG_FILE).write_text(yaml_text)
        save_model(obj, str(tmp / WEIGHTS_FILE), force_contiguous=True)  # tied weights saved once
        if extra_tensors:
            save_file({k: v.detach().contiguous().cpu() for k, v in extra_tensors.items()}, str(tmp / EXTRA_FILE))
        if meta_text is not None:
            (tmp / META_FILE).write_text(meta_text)
        _write_checksums(tmp)                  # last: a folder with it is complete
        _swap_into_place(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_checksums(folder: Path) -> None:
    sums = {p.name: _sha256(p) for p in sorted(folder.glob("*.safetensors")) if p.is_file()}
    part = folder / f".{CHECKSUM_FILE}.partial"
    part.write_text(json.dumps(sums, indent=1))
    os.replace(part, folder / CHECKSUM_FILE)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where
    the call is unavailable or refused (then nothing has moved)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0


def _swap_into_place(tmp: Path, folder: Path) -> None:
    if not folder.exists():
        os.replace(tmp, folder)
        return
    if _exchange(tmp, folder):              # folder is now the new one, tmp holds the old
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = folder.parent / f".{folder.name}.old-{os.getpid()}"
    if old.exists():
        shutil.rmtree(old)
    os.replace(folder, old)                 # a kill here leaves no `folder`: recover_checkpoint() mends it
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _complete(folder: Path) -> bool:
    return (folder / CHECKSUM_FILE).is_file() or (
        (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file() and ".old-" in folder.name)


def recover_checkpoint(folder: str | os.PathLike) -> Path | None:
    """Mend what a killed writer of ``folder`` left: if ``folder`` is missing, the newest complete
    leftover (a finished temporary folder, else the old one moved aside) becomes ``folder``;
    leftovers of writers that are no longer running are removed. Returns ``folder`` if it exists
    afterwards, else ``None``."""
    folder = Path(folder)
    if not folder.parent.is_dir():
        return None
    # our own folders too: one process saves one folder at a time, so ours are from an interrupted save
    leftovers = dead_writer_leftovers(folder, ("tmp", "old"), own_are_leftovers=True)
    if not folder.exists():
        done = sorted((p for k, p in leftovers if k == "tmp" and _complete(p)), key=lambda p: p.stat().st_mtime)
        olds = sorted((p for k, p in leftovers if k == "old" and _complete(p)), key=lambda p: p.stat().st_mtime)
        pick = (done or olds or [None])[-1]
        if pick is not None:
            os.replace(pick, folder)
            log.warning("checkpoint %s was missing after an interrupted save; restored it from %s", folder, pick.name)
    for _, p in leftovers:
        if p.exists():
            shutil.rmtree(p, ignore_errors=True)
    return folder if folder.exists() else None


def checkpoint_exists(folder: str | os.PathLike) -> bool:
    """Whether a complete checkpoint is at ``folder``, after :func:`recover_checkpoint` (use it to
    decide whether to resume)."""
    folder = Path(folder)
    recover_checkpoint(folder)
    return (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()


def verify_checkpoint(folder: str | os.PathLike) -> bool:
    """Check every weight file of ``folder`` against its ``checksums.json``. Returns ``True`` when verified,
    ``False`` for a checkpoint without checksums (written by an older wmrl; logged once per folder).

    Raises:
        CheckpointError: a file whose sha256 differs from the recorded one, or one that is missing,
            naming it.
    """
    folder = Path(folder)
    f = folder / CHECKSUM_FILE
    if not f.is_file():
        if str(folder) not in _UNVERIFIED:
            _UNVERIFIED.add(str(folder))
            log.info("%s has no %s (saved by an older wmrl): its files are not verified", folder, CHECKSUM_FILE)
        return False
    try:
        sums = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is corrupt: {e}") from None
    for name, want in sums.items():
        p = folder / name
        if not p.is_file():
            raise CheckpointError(f"{p} is missing (listed in {CHECKSUM_FILE})")
        if _sha256(p) != want:
            raise CheckpointError(f"{p} is corrupt: its sha256 differs from the one recorded when it was saved "
                                  f"({CHECKSUM_FILE}); restore it or use another checkpoint")
    return True


_UNVERIFIED: set[str] = set()


def _check_folder(folder: str | os.PathLike) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        recover_checkpoint(folder)
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint folder at {folder}")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder} is not a checkpoint: {name} is missing")
    return folder


def read_checkpoint_config(folder: str | os.PathLike) -> dict:
    """The ``config.yaml`` of a checkpoint as a plain dict (with ``_target_``)."""
    folder = _check_folder(folder)
    try:
        cfg = OmegaConf.load(folder / CONFIG_FILE)
    except Exception as e:  # noqa: BLE001 - yaml / omegaconf errors
        raise CheckpointError(f"{folder / CONFIG_FILE} is not valid YAML: {e}") from None
    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("_target_"), str):
        raise CheckpointError(f"{folder / CONFIG_FILE} has no `_target_` (the class to rebuild)")
    return cfg


def load_checkpoint(folder: str | os.PathLike, map_location: str | torch.device = "cpu",
                    strict: bool = True) -> nn.Module:
    """Rebuild the object saved by :func:`save_checkpoint` and load its weights.

    Args:
        folder: checkpoint folder.
        map_location: device for the module and its tensors.
        strict: every key of the state dict must match (default).

    Returns the module (in train mode, as constructed). Raises :class:`CheckpointError`.
    """
    import hydra.utils
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    folder = _check_folder(folder)
    verify_checkpoint(folder)
    cfg = read_checkpoint_config(folder)
    kwargs = {} if "_convert_" in cfg else {"_convert_": "all"}
    try:
        obj = hydra.utils.instantiate(cfg, **kwargs)
    except Exception as e:  # noqa: BLE001 - hydra wraps constructor errors in several types
        raise CheckpointError(f"cannot rebuild {cfg['_target_']} from {folder / CONFIG_FILE}: {e}") from e
    if not isinstance(obj, nn.Module):
        raise CheckpointError(f"{cfg['_target_']} built a {type(obj).__name__}, not an nn.Module")
    obj.to(map_location)
    try:
        missing, unexpected = load_model(obj, str(folder / WEIGHTS_FILE), strict=strict, device=str(map_location))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{folder / WEIGHTS_FILE} is corrupt or unreadable: {e}") from None
    except RuntimeError as e:
        raise CheckpointError(f"weights in {folder / WEIGHTS_FILE} do not fit {cfg['_target_']}: {e}") from None
    except Exception as e:  # noqa: BLE001 - header parse errors surface as various types
        raise CheckpointError(f"{folder / WEIGHTS_FILE} is corrupt or unreadable: {e}") from None
    return obj


def load_extra_tensors(folder: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The ``extra_tensors`` saved with a checkpoint (empty dict if none)."""
    from safetensors.torch import load_file

    folder = _check_folder(folder)
    p = folder / EXTRA_FILE
    if not p.is_file():
        return {}
    try:
        return load_file(str(p), device=str(map_location))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{p} is corrupt or unreadable: {e}") from None


def load_checkpoint_meta(folder: str | os.PathLike) -> dict:
    """The ``meta`` dict saved with a checkpoint (empty dict if none)."""
    folder = _check_folder(folder)
    p = folder / META_FILE
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p} is corrupt: {e}") from None


# ---------------------------------------------------------------------------- optimizer state
def optimizer_to_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split ``opt.state_dict()`` into named tensors (``opt/<param index>/<key>``) and a JSON-able rest
    (``{"param_groups": ..., "scalars": {"<param index>/<key>": value}}``), for a checkpoint's
    ``extra.safetensors`` and meta. The one optimizer-state format of every trainer; no pickle."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt/{pid}/{k}"] = v
            else:
                scalars[f"{pid}/{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Inverse of :func:`optimizer_to_tensors`: load the state into ``opt``."""
    state: dict[int, dict] = {}
    for name, v in tensors.items():
        if not name.startswith("opt/"):
            continue
        _, pid, k = name.split("/", 2)
        state.setdefault(int(pid), {})[k] = v
    for key, v in meta.get("scalars", {}).items():
        pid, k = key.split("/", 1)
        state.setdefault(int(pid), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
