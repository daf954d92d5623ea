"""MJCF repair for replaying robosuite demo files: the recorded scene's asset paths (absolute paths
of the recording machine) are rewritten to the installed robosuite's assets, then the text is
compiled with MuJoCo. Used by ``robomimic_inspect.py`` (validation) and ``robomimic.py`` (replay).

Errors: ``ValueError`` from :func:`repair_mjcf` / :func:`compile_mjcf` (the caller wraps it in a
:class:`~wmrl.kernel.storage.errors.DemoImportError` naming file and episode);
:func:`installed_robosuite_assets` raises ``DemoImportError`` when robosuite is absent.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from wmrl.kernel.storage.errors import DemoImportError

__all__ = ["ASSETS_MARKER", "MjcfRepair", "compile_mjcf", "installed_robosuite_assets", "repair_mjcf",
           "robosuite_version"]

ASSETS_MARKER = "robosuite/models/assets/"


def installed_robosuite_assets() -> Path:
    """Folder ``robosuite/models/assets`` of the installed robosuite (found without importing it,
    which would print warnings and be slow). Raises ``DemoImportError`` if robosuite is absent."""
    spec = importlib.util.find_spec("robosuite")
    if spec is None or not spec.submodule_search_locations:
        raise DemoImportError("robosuite", "robosuite is not installed; `pip install robosuite==1.5.1`")
    return Path(next(iter(spec.submodule_search_locations))) / "models" / "assets"


def robosuite_version() -> str:
    """Version string of the installed robosuite (``"not installed"`` without it)."""
    try:
        return importlib.metadata.version("robosuite")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "not installed"


@dataclass
class MjcfRepair:
    """What :func:`repair_mjcf` did: ``rewritten`` maps recorded path -> installed path (those
    found by file name only are also listed in ``by_name``); ``missing`` lists recorded paths with
    no installed counterpart."""

    rewritten: dict[str, str] = field(default_factory=dict)
    by_name: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


class _AssetIndex:
    """Index of the installed robosuite assets: relative path set + file name -> relative paths."""

    def __init__(self, root: Path):
        self.root = root
        self.rel: set[str] = set()
        self.by_name: dict[str, list[str]] = {}
        for p in root.rglob("*"):
            if p.is_file():
                r = p.relative_to(root).as_posix()
                self.rel.add(r)
                self.by_name.setdefault(p.name, []).append(r)

    def locate(self, recorded: str) -> tuple[str | None, bool]:
        """Installed absolute path for a recorded asset path, and whether it was found by name only."""
        norm = recorded.replace("\\", "/")
        if ASSETS_MARKER in norm:
            suffix = os.path.normpath(norm.split(ASSETS_MARKER, 1)[1]).replace("\\", "/")
            if suffix in self.rel:
                return str(self.root / suffix), False
            rec_parts = suffix.split("/")
        else:
            rec_parts = os.path.normpath(norm).replace("\\", "/").split("/")
        cands = self.by_name.get(rec_parts[-1], [])
        if not cands:
            return None, False

        def common_suffix(c: str) -> int:
            cp, n = c.split("/"), 0
            while n < min(len(cp), len(rec_parts)) and cp[-1 - n] == rec_parts[-1 - n]:
                n += 1
            return n

        scores = [common_suffix(c) for c in cands]
        best = max(scores)
        winners = [c for c, s in zip(cands, scores) if s == best]
        if len(winners) > 1:  # ambiguous: same file name in several places, same shared suffix
            # prefer the one sharing the most leading folders (e.g. "robots/panda/...")
            def common_prefix(c: str) -> int:
                cp, n = c.split("/"), 0
                while n < min(len(cp), len(rec_parts)) and cp[n] == rec_parts[n]:
                    n += 1
                return n
            pre = [common_prefix(c) for c in winners]
            if pre.count(max(pre)) > 1:
                return None, False
            winners = [winners[pre.index(max(pre))]]
        return str(self.root / winners[0]), True


_INDEX_CACHE: dict[Path, _AssetIndex] = {}


def _asset_index(root: Path) -> _AssetIndex:
    """The :class:`_AssetIndex` of ``root``, built once per process."""
    if root not in _INDEX_CACHE:
        _INDEX_CACHE[root] = _AssetIndex(root)
    return _INDEX_CACHE[root]


_NUMERIC_ATTRS = {"pos", "quat", "size", "rgba", "axis", "range", "euler", "axisangle", "xyaxes",
                  "zaxis", "fromto", "friction", "solref", "solimp", "margin", "gap", "mass",
                  "diaginertia", "fullinertia", "scale", "ctrlrange", "forcerange", "gear", "damping",
                  "stiffness", "armature", "frictionloss", "springref", "ref", "density", "fovy"}
_BAD_NUMBER = re.compile(r"[\[\](),]")


def repair_mjcf(xml: str, assets_root: Path | None = None, base_dir: Path | None = None
                ) -> tuple[str, MjcfRepair]:
    """Rewrite the asset ``file=`` paths of a recorded MJCF to the installed robosuite's assets.

    Each recorded path is located by its suffix after ``robosuite/models/assets/``; when that file
    does not exist in the installed robosuite (robosuite 1.5 moved e.g. the robot mount meshes from
    ``mounts/`` to ``bases/``), by its file name, picking the installed file sharing the longest
    path suffix (and then prefix); a relative path that exists under ``base_dir`` is kept.

    Args:
        xml: MJCF text.
        assets_root: installed ``robosuite/models/assets`` (default: found automatically).
        base_dir: folder relative paths are taken from (the XML's folder).

    Returns:
        (repaired MJCF text, :class:`MjcfRepair`). The text is unchanged when nothing was missing.

    Raises:
        ValueError: the text is not XML, a numeric attribute holds a non-number (e.g. a Python
            list ``"[0, 0, 0.005]"``), or some referenced files have no installed counterpart
            (all of them are listed).
    """
    assets_root = assets_root or installed_robosuite_assets()
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as e:
        raise ValueError(f"the MJCF is not valid XML ({e})") from None
    if root.tag != "mujoco":
        raise ValueError(f"the MJCF root element is <{root.tag}>, expected <mujoco>")
    bad = []
    for el in root.iter():
        for k, v in el.attrib.items():
            if k in _NUMERIC_ATTRS and _BAD_NUMBER.search(v):
                bad.append(f"<{el.tag} name={el.get('name')!r}> {k}={v!r}")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ValueError(
            "the MJCF holds non-numeric values in numeric attributes (a Python list printed into the "
            f"XML by the recording robosuite version): {'; '.join(bad[:3])}{more}. MuJoCo expects "
            "space-separated numbers; re-record the demo or fix the attributes")
    index = _asset_index(assets_root)
    rep = MjcfRepair()
    for el in root.iter():
        f = el.get("file")
        if f is None:
            continue
        if not os.path.isabs(f) and base_dir is not None and (base_dir / f).is_file():
            new = str((base_dir / f).resolve())
            by_name = False
        else:
            new, by_name = index.locate(f)
        if new is None:
            rep.missing.append(f)
            continue
        if new != f:
            rep.rewritten[f] = new
            if by_name:
                rep.by_name.append(f)
        el.set("file", new)
    if rep.missing:
        names = sorted({m.split(ASSETS_MARKER)[-1] for m in rep.missing})
        more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
        raise ValueError(
            f"the MJCF references {len(rep.missing)} asset file(s) that the installed robosuite "
            f"{robosuite_version()} does not ship: {', '.join(names[:5])}{more}. This recording needs the "
            "robosuite release it was made with (its assets), or a hand-repaired MJCF")
    return ET.tostring(root, encoding="unicode"), rep


def compile_mjcf(xml: str):
    """Compile MJCF text with MuJoCo; ``ValueError`` with MuJoCo's own message on failure."""
    import mujoco

    try:
        return mujoco.MjModel.from_xml_string(xml)
    except Exception as e:  # noqa: BLE001 - any MuJoCo parser/compiler failure becomes one clear ValueError
        msg = " ".join(str(e).split())
        raise ValueError(f"MuJoCo cannot compile the repaired MJCF: {msg}") from None
