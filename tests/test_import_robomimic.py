"""robomimic/robosuite demo.hdf5 import: MJCF repair, state replay rendering (upright), proprio,
clear errors for broken files, nothing written on bad input, and the lift acceptance (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from omegaconf import OmegaConf

from wmrl.kernel.storage.robomimic import (
    DemoImportError,
    StateReplayRenderer,
    compile_mjcf,
    inspect_robomimic,
    installed_robosuite_assets,
    repair_mjcf,
)
from wmrl.run.common import RunContext

LIFT = "robosuite_demos/rs1.4.1_lift_panda/demo.hdf5"
REFERENCE = "derived/rs1.4.1_lift_demo1_agentview_t0_t240_t481_mujoco_renderer.png"
REF_STEPS = (0, 240, 481)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0 ** 2 / max(mse, 1e-12)))


def reference_frames(shared_data: Path) -> list[np.ndarray]:
    """The reference PNG is three 128x128 agentview frames side by side (t = 0, 240, 481)."""
    from PIL import Image

    ref = np.asarray(Image.open(shared_data / REFERENCE).convert("RGB"))
    assert ref.shape == (128, 3 * 128, 3), ref.shape
    return [ref[:, 128 * k:128 * (k + 1)] for k in range(3)]


def make_demo_file(shared_data: Path, path: Path, steps=(6, 6), action_nan_at=None, drop_state_col=False) -> Path:
    """A tiny demo file from slices of the real lift demos (same MJCF and attrs)."""
    with h5py.File(shared_data / LIFT, "r") as src, h5py.File(path, "w") as dst:
        g = dst.create_group("data")
        for k, v in src["data"].attrs.items():
            g.attrs[k] = v
        for i, T in enumerate(steps, start=1):
            s = src["data"][f"demo_{i}"]
            d = g.create_group(f"demo_{i}")
            d.attrs["model_file"] = s.attrs["model_file"]
            a = np.array(s["actions"][:T])
            st = np.array(s["states"][:T])
            if action_nan_at is not None and i == 1:
                a[action_nan_at] = np.nan
            if drop_state_col:
                st = st[:, :-1]
            d.create_dataset("actions", data=a)
            d.create_dataset("states", data=st)
    return path


def import_cfg(**kw):
    base = OmegaConf.load(Path(__file__).resolve().parents[1] / "configs" / "import.yaml")
    base.pop("defaults", None)
    return OmegaConf.merge(base, {"num_threads": 1, "seed": 0, "progress": False, **kw})


# ------------------------------------------------------------------ MJCF repair

def test_repair_rewrites_recording_paths_and_moved_mount(shared_data):
    with h5py.File(shared_data / LIFT, "r") as f:
        xml = f["data/demo_1"].attrs["model_file"]
    assert "/Users/" in xml
    fixed, rep = repair_mjcf(xml)
    assets = installed_robosuite_assets()
    assert "/Users/" not in fixed
    assert all(Path(p).is_file() and str(assets) in p for p in rep.rewritten.values())
    # robosuite 1.5 moved the mount meshes (mounts/ -> bases/): found by file name
    moved = [p for p in rep.by_name if p.endswith("rethink_mount/pedestal.stl")]
    assert moved and rep.rewritten[moved[0]].endswith("bases/meshes/rethink_mount/pedestal.stl")
    model = compile_mjcf(fixed)
    assert (model.nq, model.nv) == (16, 15)  # 1 + nq + nv = 32 columns of the recorded states


def test_repair_rejects_unknown_assets_and_python_lists():
    xml = '<mujoco><asset><mesh name="m" file="/x/robosuite/models/assets/robots/panda/meshes/link0_vis.stl"/></asset></mujoco>'
    with pytest.raises(ValueError, match="link0_vis.stl"):
        repair_mjcf(xml)
    xml = '<mujoco><worldbody><site name="s" pos="[0, 0, 0.005]"/></worldbody></mujoco>'
    with pytest.raises(ValueError, match="Python list"):
        repair_mjcf(xml)
    with pytest.raises(ValueError, match="not valid XML"):
        repair_mjcf("<mujoco><worldbody></mujoco>")


# ------------------------------------------------------------------ broken files

@pytest.mark.parametrize("name,reason", [
    ("rs1.0.1_door_panda", "does not ship"),
    ("rs1.0.1_wipe_panda", "Python list"),
])
def test_broken_demo_files_give_clear_errors(shared_data, name, reason):
    path = shared_data / "robosuite_demos" / "broken" / name / "demo.hdf5"
    with pytest.raises(DemoImportError) as ei:
        inspect_robomimic(path)
    e = ei.value
    assert isinstance(e, ValueError)
    msg = str(e)
    assert str(path) in msg and "data/demo_1" in msg and reason in msg
    assert e.demo == "demo_1" and e.path == str(path)


def test_broken_import_writes_nothing(shared_data, tmp_path):
    from wmrl.run.import_data import run

    out = tmp_path / "store"
    src = shared_data / "robosuite_demos" / "broken" / "rs1.0.1_wipe_panda" / "demo.hdf5"
    with pytest.raises(DemoImportError):
        run(import_cfg(source=str(src), out=str(out)), RunContext(import_cfg(), out_dir=tmp_path / "run"))
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_bad_actions_and_state_width_are_named(shared_data, tmp_path):
    p = make_demo_file(shared_data, tmp_path / "nan.hdf5", action_nan_at=3)
    with pytest.raises(DemoImportError, match=r"demo_1.*NaN/inf \(first at step 3"):
        inspect_robomimic(p)
    p = make_demo_file(shared_data, tmp_path / "cols.hdf5", drop_state_col=True)
    with pytest.raises(DemoImportError, match=r"31 columns.*nq=16, nv=15"):
        inspect_robomimic(p)
    with pytest.raises(DemoImportError, match="no episode"):
        inspect_robomimic(shared_data / LIFT, demos=["demo_9"])


def test_unknown_format_and_existing_out(tmp_path):
    from wmrl.run.import_data import ImportFormatError, detect_format, run

    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ImportFormatError, match="cannot tell the format"):
        detect_format(tmp_path / "x.txt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("data")
    with pytest.raises(FileExistsError, match="already exists"):
        run(import_cfg(source=str(tmp_path / "x.txt"), out=str(tmp_path / "out"), format="robomimic"),
            RunContext(import_cfg(), out_dir=tmp_path / "run"))
    assert (tmp_path / "out" / "keep").read_text() == "data"


# ------------------------------------------------------------------ rendering and proprio

def test_replay_agentview_is_upright_against_reference(shared_data):
    info = inspect_robomimic(shared_data / LIFT, demos=["demo_1"])
    with h5py.File(shared_data / LIFT, "r") as f:
        states = np.array(f["data/demo_1/states"])
    refs = reference_frames(shared_data)
    with StateReplayRenderer(compile_mjcf(info.demos[0].xml), ["agentview"], (128, 128)) as rr:
        frames = [rr.render(states[t])["agentview"].transpose(1, 2, 0) for t in REF_STEPS]
    up = [psnr(f, r) for f, r in zip(frames, refs)]
    flipped = [psnr(f[::-1], r) for f, r in zip(frames, refs)]
    assert min(up) > 28.0, up           # measured ~35 dB
    assert max(flipped) < 15.0, flipped  # measured ~7 dB
    assert frames[0].dtype == np.uint8


def test_proprio_matches_recorded_state(shared_data):
    info = inspect_robomimic(shared_data / LIFT, demos=["demo_1"])
    with h5py.File(shared_data / LIFT, "r") as f:
        states = np.array(f["data/demo_1/states"])
    with StateReplayRenderer(compile_mjcf(info.demos[0].xml), [], (8, 8)) as rr:
        ps, dist = [], []
        base = rr.names["base"]
        for t in (0, 240, 481):
            rr.set_state(states[t])
            ps.append(rr.proprio())
            eef_world = rr.data.xpos[base] + rr.data.xmat[base].reshape(3, 3) @ ps[-1][:3]
            cube = states[t, 1 + 9:1 + 12]  # the cube's free joint follows the 9 robot joints
            dist.append(np.linalg.norm(eef_world - cube))
    ps = np.stack(ps)
    assert ps.shape == (3, 9) and ps.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ps[:, 3:7], axis=1), 1.0, atol=1e-5)
    # finger joints are qpos[7], qpos[8] of the Panda (state column 1 + 7, 1 + 8)
    np.testing.assert_allclose(ps[:, 7:9], states[[0, 240, 481]][:, 8:10], atol=1e-6)
    # the gripper starts away from the cube and holds it at the end of this successful demo
    assert dist[0] > 0.1 and dist[2] < 0.03, dist
    assert rr.names["site_name"] == "gripper0_grip_site"


# ------------------------------------------------------------------ entry point, small

def test_import_run_small_file(shared_data, tmp_path):
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run.import_data import run

    src = make_demo_file(shared_data, tmp_path / "small.hdf5", steps=(4, 5))
    cfg = import_cfg(source="small.hdf5", out="store", image_size=32)
    ctx = RunContext(cfg, out_dir=tmp_path / "run", launch_dir=tmp_path)  # relative paths -> launch dir
    report = run(cfg, ctx)
    assert report["episodes"] == 2 and report["lengths"] == [4, 5]
    assert report["format"] == "robomimic" and report["robosuite_version_recorded"] == "1.4.0"
    json.dumps(report)
    store = EpisodeStore.open(tmp_path / "store")
    assert len(store) == 2 and list(store.lengths) == [4, 5]
    meta = store.meta
    assert meta["fps"] == 20 and meta["embodiment"] == "panda"
    assert meta["cameras"] == {"agentview": [32, 32], "robot0_eye_in_hand": [32, 32]}
    asp = meta["action_space"]
    assert (asp["controller"], asp["mode"], asp["gripper_open"], asp["gripper_close"]) == ("OSC_POSE", "delta", -1.0, 1.0)
    assert str(src) in meta["source"] and "1.4.0" in meta["source"]
    ep = store.episode(1)
    assert ep.success and ep.instruction == "lift the cube" and ep.task_name == "lift"
    assert ep.images["agentview"].shape == (5, 3, 32, 32) and ep.images["agentview"].dtype == np.uint8
    assert ep.images["agentview"].std() > 5  # a real picture, not a blank buffer
    with h5py.File(src, "r") as f:
        np.testing.assert_array_equal(ep.sim_states, f["data/demo_2/states"][:])
        np.testing.assert_array_equal(ep.actions, f["data/demo_2/actions"][:].astype(np.float32))
    assert ep.rewards.tolist() == [0, 0, 0, 0, 1]


# ------------------------------------------------------------------ acceptance (slow)

@pytest.mark.slow
def test_lift_import_acceptance(shared_data, tmp_path):
    """`wmrl import` of the real lift demos: 3 episodes of 482/510/392 steps, upright agentview."""
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run.import_data import run

    cfg = import_cfg(source=str(shared_data / LIFT), out=str(tmp_path / "lift"))
    report = run(cfg, RunContext(cfg, out_dir=tmp_path / "run"))
    store = EpisodeStore.open(tmp_path / "lift")
    assert len(store) == 3 and list(store.lengths) == [482, 510, 392]
    assert report["lengths"] == [482, 510, 392]
    frames = store.array(0, "images/agentview")[list(REF_STEPS)].transpose(0, 2, 3, 1)
    refs = reference_frames(shared_data)
    up = [psnr(f, r) for f, r in zip(frames, refs)]
    flipped = [psnr(f[::-1], r) for f, r in zip(frames, refs)]
    print(f"lift import: {report['import_wall_s']} s, PSNR upright {up}, flipped {flipped}")
    assert min(up) > 28.0 and max(flipped) < 15.0


def test_quaternion_sign_is_kept_continuous():
    from wmrl.kernel.storage.robomimic import _continuous_quat

    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 4)) + np.cumsum(rng.normal(scale=0.01, size=(50, 4)), axis=0)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    flips = rng.random(50) < 0.3
    flips[0] = False
    noisy = np.where(flips[:, None], -q, q)
    _continuous_quat(noisy)
    np.testing.assert_allclose(noisy, q * np.sign(q[0] @ noisy[0]))
    assert (np.sum(noisy[1:] * noisy[:-1], axis=1) > 0).all()
