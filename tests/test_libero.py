"""LIBERO (issue #22): the restricted reader of the official init states, in the main environment.

The tests that need the LIBERO environment itself (``.venv-libero``, made by
``scripts/setup_libero.sh``) run it as a subprocess and skip with the reason when it is absent.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from sim.libero.init_states import InitStateFileError, load_pruned_init, loads_restricted

REPO = Path(__file__).resolve().parents[1]
LIBERO_PY = REPO / ".venv-libero" / "bin" / "python"
SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")


def _torch_zip(path: Path, payload: bytes, extra: dict[str, bytes] | None = None) -> Path:
    """Write ``payload`` in the layout ``torch.save`` gives a ``.pruned_init`` file."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/version", b"3\n")
        for name, data in (extra or {}).items():
            z.writestr(f"archive/{name}", data)
    return path


class _CallsSystem:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class _CallsEval:
    def __reduce__(self):
        return (eval, ("1 + 1",))


class _Persistent(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", "0") if isinstance(obj, bytes) else None


def test_shipped_init_states_load_and_match_the_numpy_copy(shared_data):
    """All 40 files of the four evaluation suites load through the allow-list and equal the
    plain-numpy copy in ``derived/libero_4suites_pruned_init_states.npz`` bit for bit."""
    ref = np.load(shared_data / "derived" / "libero_4suites_pruned_init_states.npz")
    files = sorted((shared_data / "libero" / "init_files").glob("libero_*/*.pruned_init"))
    files = [f for f in files if f.parent.name in SUITES]
    assert len(files) == 40
    for f in files:
        arr = load_pruned_init(f)
        assert arr.dtype == np.float64 and arr.shape[0] == 50
        np.testing.assert_array_equal(arr, ref[f"{f.parent.name}/{f.stem}"])


@pytest.mark.parametrize("evil", [_CallsSystem(), _CallsEval(), {"a": 1}.keys, pickle.Pickler,
                                  np.load, __import__("collections").OrderedDict([("x", np.zeros((2, 3)))])],
                         ids=["os.system", "builtins.eval", "builtin-method", "pickle.Pickler", "numpy.load",
                              "collections.OrderedDict"])
def test_any_other_global_is_refused(tmp_path, evil):
    """A crafted ``.pruned_init`` whose pickle carries any global outside the four is refused
    before anything is called, with the global's name and the allowed ones in the error."""
    payload = pickle.dumps(evil, protocol=2)
    f = _torch_zip(tmp_path / "evil.pruned_init", payload)
    with pytest.raises(InitStateFileError, match=r"refused: global .* is not allowed \(a LIBERO init-state file "
                                                 r"references only numpy\.core\.multiarray\._reconstruct"):
        load_pruned_init(f)
    bare = tmp_path / "bare.pruned_init"
    bare.write_bytes(payload)
    with pytest.raises(InitStateFileError, match="is not allowed"):
        load_pruned_init(bare)


def test_system_call_is_never_made(tmp_path, capfd):
    f = _torch_zip(tmp_path / "evil.pruned_init", pickle.dumps(_CallsSystem(), protocol=2))
    with pytest.raises(InitStateFileError, match=r"global (posix|os)\.system is not allowed"):
        load_pruned_init(f)
    assert "pwned" not in capfd.readouterr().out


def test_persistent_ids_extra_records_and_wrong_contents_are_refused(tmp_path):
    buf = io.BytesIO()
    _Persistent(buf, protocol=2).dump([b"tensor"])
    with pytest.raises(InitStateFileError, match="persistent id .* is not allowed"):
        loads_restricted(buf.getvalue())
    good = pickle.dumps(np.zeros((2, 5)), protocol=2)
    assert loads_restricted(good).shape == (2, 5)
    with pytest.raises(InitStateFileError, match="no tensor storage"):
        load_pruned_init(_torch_zip(tmp_path / "x.pruned_init", good, {"data/0": b"\0" * 8}))
    with pytest.raises(InitStateFileError, match=r"holds a float32 array of shape \(2, 5\)"):
        loads_restricted(pickle.dumps(np.zeros((2, 5), np.float32), protocol=2))
    with pytest.raises(InitStateFileError, match="holds a int"):
        loads_restricted(pickle.dumps(3, protocol=2))
    with pytest.raises(InitStateFileError, match="NaN or inf"):
        loads_restricted(pickle.dumps(np.full((1, 3), np.nan), protocol=2))
    with pytest.raises(InitStateFileError, match="refused"):
        loads_restricted(good[:20])
    with pytest.raises(FileNotFoundError, match="shared/data/libero/init_files"):
        load_pruned_init(tmp_path / "missing.pruned_init")
