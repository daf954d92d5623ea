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

from sim.libero.init_states import (
    InitStateFileError,
    load_pruned_init,
    loads_restricted,
)

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


# ----------------------------------------------------------------------------- the arm node's env kind


class FakeLiberoChunkEnv:
    """A one-slot ``ChunkEnv`` with the attributes ``arm.kind=env`` reads (what
    ``sim.libero.env.LiberoChunkEnv`` has), succeeding after ``succeed_after`` steps."""

    def __init__(self, succeed_after: int = 12, preload=None, **_libero_settings):
        from sim.libero.env import libero_action_space

        self.num_envs, self.action_dim, self.state_dim = 1, 7, 8
        self.cameras, self.image_size = ["agentview", "robot0_eye_in_hand"], (16, 16)
        self.action_space = libero_action_space()
        self.succeed_after, self.preload, self.t = succeed_after, preload, 0

    def _obs(self):
        import torch

        from wmrl.kernel.types import Obs

        return Obs({c: torch.full((1, 3, 16, 16), self.t % 255, dtype=torch.uint8) for c in self.cameras},
                   torch.zeros(1, 8), ["put it in the basket"])

    def reset(self, starts):
        self.t = 0
        return self._obs()

    def reset_slots(self, slots, starts):
        return self.reset(starts)

    def step(self, actions):
        import torch

        from wmrl.kernel.types import StepResult

        n = actions.shape[1]
        self.t += n
        ok = self.t >= self.succeed_after
        f = torch.tensor([False])
        return StepResult(self._obs(), torch.tensor([float(ok)]), torch.tensor([ok]), f, torch.tensor([ok]),
                          torch.tensor([n]))


def _starts(n: int = 2, **_libero_settings):
    from wmrl.kernel.types import Start

    return [Start(task_name=f"task_{i}", instruction="put it in the basket", init_index=i) for i in range(n)]


def test_robot_node_plays_a_chunk_env_arm_and_records_libero_action_space(tmp_path):
    """``wmrl robot --config-name robot_libero`` with the LIBERO env swapped for a fake: the node
    plays ``arm.env`` from ``arm.starts`` through the bridge and records LIBERO's action space."""
    from hydra import compose, initialize_config_module

    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run import robot
    from wmrl.run.common import RunContext

    with initialize_config_module(config_module="configs", version_base="1.3"):
        cfg = compose(config_name="robot_libero", overrides=[
            "transport=inproc", "episodes=2", "control.max_steps=40", f"store={tmp_path / 'eps'}",
            "arm.env._target_=test_libero.FakeLiberoChunkEnv", "arm.starts._target_=test_libero._starts",
            "+inproc_server.policy.chunk_size=4"])
    assert cfg.arm.env.preload == 0 and cfg.control.watchdog_s == 5.0
    rep = robot.run(cfg, RunContext(cfg, out_dir=tmp_path / "run"))
    assert rep["num_episodes"] == 2 and rep["all_ran"], rep
    assert [r["task"] for r in rep["episodes"]] == ["task_0", "task_1"]
    store = EpisodeStore.open(tmp_path / "eps")
    assert store.meta["action_space"]["frame"] == "world" and store.meta["state_dim"] == 8
    assert store.meta["cameras"] == {"agentview": [16, 16], "robot0_eye_in_hand": [16, 16]}
    assert all(store.episode(i).success for i in range(2))


def test_robot_node_reads_frames_only_for_requests_when_asked(tmp_path):
    """``control.frames=requests``: the worker's episodes succeed as before, the store marks the
    steps whose frames were read (far fewer than the steps) and repeats them in between."""
    from hydra import compose, initialize_config_module

    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run import robot
    from wmrl.run.common import RunContext

    with initialize_config_module(config_module="configs", version_base="1.3"):
        cfg = compose(config_name="robot_libero", overrides=[
            "transport=inproc", "episodes=1", "control.max_steps=60", f"store={tmp_path / 'eps'}",
            "control.frames=requests", "arm.env._target_=test_libero.FakeLiberoChunkEnv",
            "+arm.env.succeed_after=40", "arm.starts._target_=test_libero._starts",
            "+inproc_server.policy.chunk_size=16"])
    rep = robot.run(cfg, RunContext(cfg, out_dir=tmp_path / "run"))
    assert rep["all_ran"], rep
    ep = EpisodeStore.open(tmp_path / "eps").episode(0)
    fresh = ep.extras["frame_fresh"]
    assert ep.success and fresh[0] == 1 and 1 < fresh.sum() < len(fresh) / 2
    img = ep.images["agentview"][:, 0, 0, 0]
    assert all(img[t] == img[t - 1] for t in np.flatnonzero(fresh == 0))
    assert all(img[t] != img[t - 1] for t in np.flatnonzero(fresh == 1)[1:])


class _FramesEnv:
    """What ``LazyFrames`` reads of a ``LiberoEnv``: the state key and the frames of that state."""

    def __init__(self):
        self.frame_key, self.renders = (1, 0), 0

    def frames(self):
        self.renders += 1
        return {c: np.full((3, 4, 4), self.frame_key[1], np.uint8) for c in ("agentview", "robot0_eye_in_hand")}


def test_lazy_frames_render_once_when_read_and_refuse_a_stale_state():
    from sim.libero.env import LazyFrames

    env = _FramesEnv()
    lazy = LazyFrames(env)
    assert env.renders == 0 and list(lazy) == ["agentview", "robot0_eye_in_hand"] and len(lazy) == 2
    assert lazy["agentview"].shape == (1, 3, 4, 4) and int(lazy["robot0_eye_in_hand"][0, 0, 0, 0]) == 0
    assert env.renders == 1  # both cameras in one read, then cached
    with pytest.raises(KeyError):
        lazy["wrist"]
    unread = LazyFrames(env)
    env.frame_key = (1, 1)  # the env stepped
    with pytest.raises(RuntimeError, match="stale LIBERO observation"):
        unread["agentview"]
    assert int(lazy["agentview"][0, 0, 0, 0]) == 0  # frames read before the step stay valid


def test_robot_libero_config_resolves_the_worker():
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="configs", version_base="1.3"):
        cfg = compose(config_name="robot_libero", overrides=["tasks=[3,5]", "inits=[0,49]", "suite_name=libero_10"])
        srv = compose(config_name="serve_libero")
    assert cfg.arm.kind == "env" and cfg.arm.env._target_ == "sim.libero.env.LiberoChunkEnv"
    assert cfg.arm.env.suite == "libero_10" and cfg.arm.env.preload == 3 and list(cfg.arm.starts.init_indices) == [0, 49]
    assert srv.state_dim == 8 and srv.idle_timeout_s >= 60


# ----------------------------------------------------------------------------- in the LIBERO environment

needs_libero_env = pytest.mark.skipif(not LIBERO_PY.exists(), reason=f"no LIBERO environment at {LIBERO_PY.parent.parent} "
                                      f"(run `bash scripts/setup_libero.sh`; CI has none)")


@needs_libero_env
@pytest.mark.slow
def test_libero_env_matches_lerobot_on_one_task(tmp_path):
    """scripts/check_libero.py on one libero_object task: exact init states (all 50), the first
    frame of init 0 pixel-equal to lerobot's ``LiberoEnv`` + ``LiberoProcessorStep``, and 100
    fixed steps with the same success trace, frames and states (about 70 s)."""
    out = tmp_path / "check.json"
    env = dict(os.environ, MUJOCO_GL="egl", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([str(LIBERO_PY), "scripts/check_libero.py", "--suites", "libero_object", "--tasks", "0",
                        "--inits", "0", "--trace-inits", "0", "--out", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json

    s = json.loads(out.read_text())["summary"]
    assert s["set_init_state_exact"] == 50 and s["frame_equal"] == 1 and s["trace_states_equal"] == 1


@needs_libero_env
@pytest.mark.slow
def test_killed_libero_worker_fails_its_episode_and_the_evaluation_goes_on(tmp_path):
    """``wmrl evaluate suite=libero_object`` with one worker on 3 episodes (30-step limit): the
    worker is killed (SIGKILL) once it recorded episode 0, during episode 1 or (on a fast machine) 2;
    that episode counts as failed (``worker_died``) with one ERROR line, the episodes after it run on
    a new worker, and the merged store keeps every other episode (about 2-4 minutes here)."""
    import json
    import re
    import signal
    import sys
    import time

    from wmrl.kernel.storage import EpisodeStore

    out = tmp_path / "ev"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "wmrl.cli", "evaluate", "suite=libero_object", "checkpoint=test_policy",
                             "tasks=[0]", "suite.inits=[0,1,2]", "workers=1", "videos_per_task=1",
                             'suite.worker_overrides=["+arm.env.max_steps=30"]', f"hydra.run.dir={out}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store = out / "workers" / "0_0" / "episodes"
    t_end = time.monotonic() + 600
    while time.monotonic() < t_end and proc.poll() is None:
        time.sleep(1)
        try:
            if len(EpisodeStore.open(store, mode="r")) >= 1:
                break
        except Exception:  # noqa: BLE001 - not created yet
            continue
    assert proc.poll() is None, proc.communicate()[0][-4000:]
    time.sleep(2)  # episode 1 under way (its reset takes 4-5 s); a fast machine may be in episode 2
    pid = int(re.search(r"worker 0\.0 started \(pid (\d+)\)", (out / "evaluate.log").read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    text, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, text[-4000:]
    m = re.search(r"ERROR.*LIBERO env worker 0\.0 \(pid \d+\) exited with status -9 during episode ([12]) of its 3 "
                  r"\(task pick_up_the_alphabet_soup_and_place_it_in_the_basket, init ([12])\): that episode counts as "
                  r"failed \(worker_died\)", (out / "evaluate.log").read_text())
    assert m is not None and m.group(1) == m.group(2), (out / "evaluate.log").read_text()[-2000:]
    k = int(m.group(1))
    rep = json.loads((out / "report.json").read_text())
    labels = [(r["init_index"], r["failure_label"], r["worker"]) for r in rep["episodes"]]
    assert labels[k] == (k, "worker_died", "0.0") and all(w == "0.0" for _, _, w in labels[:k]), labels
    assert all(w == "0.1" for _, _, w in labels[k + 1:]), labels
    assert rep["episodes_worker_died"] == 1 and len(rep["worker_restarts"]) == 1
    merged = EpisodeStore.open(out / "episodes", mode="r")
    assert [merged.episode(i).info["init_index"] for i in range(len(merged))] == [i for i in range(3) if i != k]


@needs_libero_env
@pytest.mark.slow
def test_libero_evaluation_with_two_workers_runs_them_from_ray_actors(tmp_path):
    """``workers=2``: each LIBERO env worker is started by a one-CPU Ray actor on this node
    (``wmrl.kernel.workers.RayProcess``); the two workers run their dealt episodes and the report and
    the merged store hold the same plan (task, init, seed) as ``workers=1``. (The bridge streams
    chunks asynchronously in real time, so the executed actions are not compared.)"""
    import json
    import sys

    from wmrl.kernel.storage import EpisodeStore

    plans = {}
    for w in (1, 2):
        out = tmp_path / f"w{w}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
        p = subprocess.run([sys.executable, "-m", "wmrl.cli", "evaluate", "suite=libero_object", "checkpoint=test_policy",
                            "tasks=[0]", "suite.inits=[0,1]", f"workers={w}", "videos_per_task=0",
                            'suite.worker_overrides=["+arm.env.max_steps=20"]', f"hydra.run.dir={out}"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        rep = json.loads((out / "report.json").read_text())
        assert rep["workers"] == w and rep["episodes_worker_died"] == 0
        plans[w] = [(r["task"], r["init_index"], r["seed"]) for r in rep["episodes"]]
        merged = EpisodeStore.open(out / "episodes", mode="r")
        assert [merged.episode(i).info["init_index"] for i in range(len(merged))] == [0, 1]
        log_text = (out / "evaluate.log").read_text()
        assert (", on Ray)" in log_text) == (w > 1)
        assert {r["worker"] for r in rep["episodes"]} == ({"0.0"} if w == 1 else {"0.0", "1.0"})
    assert plans[1] == plans[2]


def test_object_place_expert_on_a_kinematic_arm():
    """The libero_object expert's commands on a point arm that moves 0.05 m per unit command (OSC_POSE
    delta scale) and carries the object once closed on it: it reaches, closes (+1), lifts, carries
    over the basket, lowers and opens (-1), with every command in [-1, 1] and no rotation."""
    from sim.libero.expert import ObjectPlaceExpert

    eef, obj, basket = np.array([-0.15, 0.0, 0.25]), np.array([0.05, -0.10, 0.05]), np.array([0.0, 0.25, 0.0])
    ex = ObjectPlaceExpert("milk_1")
    held, grips, phases = False, [], []
    for _ in range(300):
        a = ex.act({"robot0_eef_pos": eef, "milk_1_pos": obj, "basket_1_pos": basket})
        assert a.shape == (7,) and np.all(np.abs(a) <= 1) and not a[3:6].any()
        eef = eef + 0.05 * 0.5 * a[:3]  # the OSC reaches half the commanded step
        held = (held or (a[6] > 0 and np.linalg.norm(eef - obj) < 0.011)) and a[6] > 0
        if held:
            obj = eef.copy()
        grips.append(a[6])
        phases.append(ex.phase)
    assert phases[-1] == "release" and grips[0] == -1.0 and grips[-1] == -1.0 and max(grips) == 1.0
    assert np.linalg.norm(obj[:2] - basket[:2]) < 0.02 and obj[2] < 0.2


@needs_libero_env
@pytest.mark.slow
def test_libero_pipeline_runs_end_to_end(tmp_path):
    """``wmrl pipeline suite=libero_object preset=debug`` on one task: 2 expert demos on sampled
    placements, tiny BC / world model / critic, GRPO in imagination from the demos' first frames,
    evaluation before and after on official init state 0 through a LIBERO env worker (32-step cap);
    the report has every stage's time and the imagination-vs-LIBERO speed (about 3 minutes here)."""
    import json
    import sys

    out = tmp_path / "p"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MUJOCO_GL="egl")
    r = subprocess.run([sys.executable, "-m", "wmrl.cli", "pipeline", "suite=libero_object", "preset=debug",
                        "libero.tasks=[0]", "libero.demos.placements=2", "libero.demos.workers=1", "libero.inits=[0]",
                        "libero.workers=1", "libero.grpo.grpo.max_chunks=2", "libero.grpo.env.imagination.max_chunks=2",
                        "suite.max_steps_cap=32", "+stages.worldmodel.heldout_every=2",
                        "+stages.critic.heldout_every=2", f"hydra.run.dir={out}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["stages"]) == {"collect", "bc", "worldmodel", "critic", "eval_before", "grpo", "eval_after"}
    assert rep["before"]["episodes"] == 1 and rep["after"]["episodes"] == 1
    assert rep["speed"]["imagination_steps_per_s"] > 0 and rep["speed"]["libero_steps_per_s_per_process"] > 0
    assert sum(v["episodes"] for v in rep["demos"]["expert_success"].values()) == 2
