"""The import rule of ``docs/architecture.md``, read from every module's source (``ast``; imports
inside functions count too):

* the kernel (``wmrl.kernel``) imports no component and nothing else of ``wmrl``;
* a component (``worldmodels``, ``policies``, ``sim``, ``robot_bridge``) imports only the kernel
  and itself, never another component;
* the engine (the rest of ``wmrl`` outside ``wmrl.run`` and ``wmrl.cli``: RL, imagination,
  fidelity, refresh) imports the kernel only, no component and no entry point;
* no module of ``wmrl.run`` imports an entry point (a module ``wmrl.cli`` dispatches to); shared
  composition code lives in ``wmrl.run``'s non-entry modules, which import no entry point either.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("worldmodels", "policies", "sim", "robot_bridge")
PACKAGES = ("wmrl",) + COMPONENTS


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, name: str) -> list[tuple[int, list[str]]]:
    """Per import statement of ``path``: its line and the absolute module names it may load
    (relative imports resolved against ``name``; ``from pkg import x`` gives ``pkg`` and ``pkg.x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: list[tuple[int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, [a.name]) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, [mod] + [f"{mod}.{a.name}" for a in node.names]))
    return out


def entry_points() -> set[str]:
    sys.path.insert(0, str(ROOT))
    try:
        from wmrl.cli import BENCHES, SUBCOMMANDS
    finally:
        sys.path.pop(0)
    mods = {f"wmrl.run.{m}" for n, (m, _) in SUBCOMMANDS.items() if n != "bench"}
    return mods | {f"wmrl.run.bench_{b}" for b in BENCHES}


def layer(mod: str) -> str:
    top = mod.split(".")[0]
    if top in COMPONENTS:
        return "component"
    if mod == "wmrl.kernel" or mod.startswith("wmrl.kernel."):
        return "kernel"
    if mod == "wmrl.run" or mod.startswith("wmrl.run.") or mod == "wmrl.cli":
        return "root"
    if top == "wmrl":
        return "engine"
    return "external"


def rule_broken(mod: str, target: str, entries: set[str]) -> str | None:
    """Why ``mod`` may not import ``target``, or ``None`` when it may."""
    src, dst = layer(mod), layer(target)
    if dst == "external" or target == "wmrl":
        return None
    if src == "kernel" and dst != "kernel":
        return "the kernel imports no component and nothing above it"
    if src == "component":
        if dst == "component" and target.split(".")[0] != mod.split(".")[0]:
            return "components never import each other"
        if dst in ("engine", "root"):
            return "a component imports only the kernel"
    if src == "engine" and dst in ("component", "root"):
        return "the engine imports the kernel only (components are put together in wmrl.run)"
    if src == "root" and mod != "wmrl.cli" and target in entries and target != mod:
        return "entry points never import each other (shared code goes in a non-entry module)"
    return None


def violations(root: Path, entries: set[str]) -> list[str]:
    found = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            mod = module_name(path, root)
            for line, targets in imported_modules(path, mod):
                for target in targets:
                    why = rule_broken(mod, target, entries)
                    if why:
                        found.append(f"{path.relative_to(root)}:{line} imports {target}: {why}")
                        break
    return found


def test_no_module_breaks_the_import_rule():
    found = violations(ROOT, entry_points())
    assert not found, "forbidden imports:\n  " + "\n  ".join(found)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("rel, source, why", [
    ("wmrl/kernel/types.py", "from policies.flow_vla import FlowVLAPolicy\n", "the kernel imports no component"),
    ("wmrl/kernel/types.py", "def f():\n    import wmrl.run.pipeline\n", "the kernel imports no component"),
    ("policies/flow_vla.py", "from worldmodels import video_wm\n", "components never import each other"),
    ("sim/env.py", "from wmrl.rl import rollout\n", "a component imports only the kernel"),
    ("wmrl/refresh.py", "from worldmodels.train import train\n", "the engine imports the kernel only"),
    ("wmrl/run/pipeline.py", "from wmrl.run.post_train import run\n", "entry points never import each other"),
    ("wmrl/run/pipeline.py", "from wmrl.run import post_train\n", "entry points never import each other"),
    ("policies/train.py", "from . import flow_vla\nfrom ..sim import env\n", "components never import each other"),
])
def test_a_forbidden_import_is_caught(tmp_path, rel, source, why):
    root = _tree(tmp_path, {rel: source})
    found = violations(root, {"wmrl.run.pipeline", "wmrl.run.post_train"})
    assert len(found) == 1 and why in found[0], found


def test_allowed_imports_pass(tmp_path):
    root = _tree(tmp_path, {
        "wmrl/kernel/checkpoint.py": "import torch\nfrom wmrl.kernel.rng import capture_rng\n",
        "policies/flow_vla.py": "from wmrl.kernel.types import Obs\nfrom .samplers import EulerODESampler\n",
        "wmrl/imagination.py": "from wmrl.kernel.interfaces import ChunkEnv\n",
        "wmrl/run/pipeline.py": "from wmrl.run.builders import make_policy\nfrom worldmodels import video_wm\n",
        "wmrl/cli.py": "from wmrl.run import pipeline\n",
    })
    assert violations(root, {"wmrl.run.pipeline", "wmrl.run.post_train"}) == []
