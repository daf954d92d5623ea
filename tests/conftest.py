"""Test-wide settings: one torch thread (2-core machines slow down 20x when oversubscribed),
headless EGL rendering, paths to the shared real data, and a home directory of their own: ``HOME``
points at an empty folder for the session (every process a test starts inherits it), and the run
fails when anything was written there (issue #23: no file left under the home directory). Library
caches that default to the home directory (Hugging Face ``datasets``' parquet cache, which lerobot's
dataset reader fills; XDG caches and configs; matplotlib's) go to a session folder outside it, removed at the end."""

import os
import tempfile
from pathlib import Path

TEST_HOME = tempfile.mkdtemp(prefix="wmrl-test-home-")
os.environ["HOME"] = TEST_HOME
TEST_CACHE = tempfile.mkdtemp(prefix="wmrl-test-cache-")
os.environ["HF_HOME"] = os.path.join(TEST_CACHE, "huggingface")
os.environ["HF_DATASETS_CACHE"] = os.path.join(TEST_CACHE, "huggingface", "datasets")
os.environ["XDG_CACHE_HOME"] = TEST_CACHE
os.environ["XDG_CONFIG_HOME"] = os.path.join(TEST_CACHE, "config")
os.environ["MPLCONFIGDIR"] = os.path.join(TEST_CACHE, "matplotlib")

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("WMRL_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (set WMRL_SHARED_DATA)")
    return SHARED_DATA


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when a test left files under ``HOME`` (then remove the folder)."""
    import shutil

    left = sorted(str(p.relative_to(TEST_HOME)) for p in Path(TEST_HOME).rglob("*"))
    shutil.rmtree(TEST_HOME, ignore_errors=True)
    shutil.rmtree(TEST_CACHE, ignore_errors=True)
    if left:
        where = sorted({"/".join(Path(p).parts[:2]) for p in left})
        print(f"\nFAILED: the tests wrote {len(left)} paths under the home directory, in {where}")
        session.exitstatus = 1
