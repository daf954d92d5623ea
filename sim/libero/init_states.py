"""LIBERO's official evaluation init states (``<task>.pruned_init``), read without an open pickle.

A ``.pruned_init`` file (LIBERO ``libero/libero/init_files/<suite>/<task>.pruned_init``, shipped in
``../shared/data/libero/init_files``) is what ``torch.save`` wrote for one numpy array: a zip archive
holding ``<name>/data.pkl`` (a protocol-2 pickle) and ``<name>/version``. The pickle of every shipped
file references exactly four globals -- ``numpy.core.multiarray._reconstruct``, ``numpy.ndarray``,
``numpy.dtype`` and ``_codecs.encode`` (the numpy array protocol of ``ndarray.__reduce__``) -- and no
torch storage (no persistent id). LIBERO and lerobot load them with ``torch.load(weights_only=False)``
(an open pickle, which can run any code); ``torch.load(weights_only=True)`` refuses them.

:func:`load_pruned_init` unpickles with an explicit allow-list of those four globals (resolved to
numpy's and the standard library's own functions, never through an import of the name read from the
file), refuses any other global, any persistent id and any result that is not a finite 2-D float64
array, and raises :class:`InitStateFileError` naming the file and what it carried.

Result: ``float64 (N, 1 + nq + nv)`` flattened MuJoCo states (``N = 50`` for the four evaluation
suites; e.g. ``(50, 110)`` for a libero_object task), the layout of robosuite 1.4's
``env.sim.get_state().flatten()``: time, qpos, qvel. Pure Python: runs in the main environment too.
"""

from __future__ import annotations

import codecs
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np

__all__ = ["ALLOWED_GLOBALS", "InitStateFileError", "load_pruned_init", "loads_restricted"]


def _numpy_reconstruct():
    try:  # numpy >= 2 moved numpy.core to numpy._core (numpy.core is a deprecated alias there)
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _encode_latin1(obj, encoding="utf-8", errors="strict"):
    """``_codecs.encode`` as numpy's pickles use it: ``encode(str, "latin1") -> bytes`` only."""
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise pickle.UnpicklingError(f"_codecs.encode allowed only as encode(str, 'latin1'), got "
                                     f"encode({type(obj).__name__}, {encoding!r}, {errors!r})")
    return codecs.encode(obj, "latin1")


#: ``(module, name)`` as written in the pickle -> the object it stands for.
ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct(),
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct(),
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _encode_latin1,
}


class InitStateFileError(ValueError):
    """A ``.pruned_init`` file (or pickle) that is not a plain float64 init-state array."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            allowed = ", ".join(f"{m}.{n}" for m, n in ALLOWED_GLOBALS)
            raise pickle.UnpicklingError(
                f"global {module}.{name} is not allowed (a LIBERO init-state file references only {allowed})"
            ) from None

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"persistent id {str(pid)[:80]!r} (a torch storage) is not allowed: "
                                     f"LIBERO init states are pickled numpy arrays")


def loads_restricted(data: bytes, what: str = "pickle") -> np.ndarray:
    """Unpickle ``data`` with the allow-list and check the result.

    Returns:
        ``float64 (N, D)`` C-contiguous, finite.

    Raises:
        InitStateFileError: a global outside :data:`ALLOWED_GLOBALS`, a persistent id, a broken
            pickle, or a result that is not a finite 2-D float64 array.
    """
    try:
        arr = _AllowListUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise InitStateFileError(f"{what}: refused: {e}") from None
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float64 or arr.ndim != 2:
        desc = f"{arr.dtype} array of shape {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise InitStateFileError(f"{what}: holds a {desc}; a LIBERO init-state file holds float64 (N, 1 + nq + nv)")
    if not np.isfinite(arr).all():
        raise InitStateFileError(f"{what}: init states contain NaN or inf")
    return np.ascontiguousarray(arr)


def load_pruned_init(path: str | Path) -> np.ndarray:
    """The init states of one LIBERO task, ``float64 (N, 1 + nq + nv)``, from its ``.pruned_init``.

    Accepts the zip layout ``torch.save`` writes (one ``*/data.pkl`` member) and a bare pickle.

    Raises:
        FileNotFoundError: no such file (names the folder to look in).
        InitStateFileError: anything but a plain float64 array (see :func:`loads_restricted`), or a
            zip archive with other records than ``data.pkl`` / ``version`` / ``byteorder``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no LIBERO init-state file {path} (the shipped ones are in "
                                f"../shared/data/libero/init_files/<suite>/<task>.pruned_init)")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            records = {n.split("/", 1)[-1] for n in names}
            extra = records - {"data.pkl", "version", "byteorder", ".data/version", ".data/serialization_id"}
            pkls = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
            if extra or len(pkls) != 1:
                raise InitStateFileError(f"{path}: refused: archive records {sorted(records)}; a LIBERO init-state "
                                         f"file holds one data.pkl (a numpy array) and no tensor storage")
            data = z.read(pkls[0])
    else:
        data = path.read_bytes()
    return loads_restricted(data, str(path))
