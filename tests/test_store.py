"""EpisodeStore: round trip, windows and padding, crash safety (SIGKILL), concurrent readers,
bad input (clear errors, nothing stored lost), WindowDataset and the masked loss."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from wmrl.kernel.storage import (
    EpisodeStore,
    EpisodeValidationError,
    StoreError,
    StoreExistsError,
    StoreFormatError,
    WindowDataset,
    masked_mse,
)
from wmrl.kernel.storage.synthetic import random_episode, random_store
from wmrl.kernel.types import PANDA_OSC_POSE, ActionSpace

REPO = Path(__file__).resolve().parents[1]
CAMS = {"agentview": (8, 8), "robot0_eye_in_hand": (6, 10)}


def assert_episode_equal(a, b):
    assert set(a.images) == set(b.images)
    for c in a.images:
        np.testing.assert_array_equal(a.images[c], b.images[c])
    np.testing.assert_array_equal(a.proprio, b.proprio)
    np.testing.assert_array_equal(a.actions, b.actions)
    np.testing.assert_array_equal(a.rewards, b.rewards)
    assert a.success == b.success and a.instruction == b.instruction and a.task_name == b.task_name
    assert a.info == b.info
    if a.sim_states is None:
        assert b.sim_states is None
    else:
        np.testing.assert_array_equal(a.sim_states, b.sim_states)
    assert set(a.extras) == set(b.extras)
    for k in a.extras:
        np.testing.assert_array_equal(a.extras[k], b.extras[k])


@pytest.fixture
def store(tmp_path):
    return EpisodeStore.create(tmp_path / "s", cameras=CAMS, state_dim=9, action_dim=7, fps=20,
                               action_space=PANDA_OSC_POSE, embodiment="panda", source="test")


# ---------------------------------------------------------------------- round trip and metadata
def test_append_and_read_back(store, tmp_path):
    e0 = random_episode(5, CAMS, seed=0, sim_state_dim=4)
    e0.extras = {"timestamp": np.arange(5) / 20.0, "latency": np.ones((5, 2), np.float32)}
    e0.info = {"init_index": 3, "label": "ok"}
    e1 = random_episode(3, CAMS, seed=1, success=False, instruction="other", task_name="t2")
    assert store.append(e0) == 0
    assert store.append(e1) == 1
    r = EpisodeStore.open(tmp_path / "s")
    assert len(r) == 2
    assert r.lengths.dtype == np.int64 and r.lengths.tolist() == [5, 3]
    assert r.successes.tolist() == [True, False]
    assert r.task_names == ["lift", "t2"] and r.instructions == ["lift the cube", "other"]
    assert_episode_equal(r.episode(0), e0)
    assert_episode_equal(r.episode(-1), e1)
    only = r.episode(0, cameras=["agentview"])
    assert list(only.images) == ["agentview"]
    assert r.episode(0, images=False).images == {}
    m = r.meta
    assert m["cameras"] == {"agentview": [8, 8], "robot0_eye_in_hand": [6, 10]}
    assert (m["state_dim"], m["action_dim"], m["fps"]) == (9, 7, 20.0)
    assert m["embodiment"] == "panda" and m["source"] == "test" and m["format_version"] == 1
    assert ActionSpace.from_dict(m["action_space"]) == PANDA_OSC_POSE
    assert r.action_space.mode == "delta" and r.action_space.gripper_close == 1.0
    with pytest.raises(IndexError):
        r.episode(2)


def test_window_padding_at_both_ends(store):
    e = random_episode(6, CAMS, seed=3)
    store.append(e)
    w = store.window(0, 1, n_obs=3, horizon=4)
    assert w["images"]["agentview"].shape == (3, 3, 8, 8) and w["images"]["agentview"].dtype == np.uint8
    assert w["obs_pad"].tolist() == [True, False, False]
    np.testing.assert_array_equal(w["proprio"], e.proprio[[0, 0, 1]])
    np.testing.assert_array_equal(w["images"]["robot0_eye_in_hand"], e.images["robot0_eye_in_hand"][[0, 0, 1]])
    np.testing.assert_array_equal(w["actions"], e.actions[1:5])
    assert not w["action_pad"].any()
    w = store.window(0, 4, n_obs=2, horizon=4, n_future=3)
    assert w["action_pad"].tolist() == [False, False, True, True]
    np.testing.assert_array_equal(w["actions"], e.actions[[4, 5, 5, 5]])  # padding repeats the last action
    np.testing.assert_array_equal(w["rewards"], e.rewards[[4, 5, 5, 5]])
    assert w["future_pad"].tolist() == [False, True, True]
    np.testing.assert_array_equal(w["future_proprio"], e.proprio[[5, 5, 5]])
    assert (w["episode"], w["step"], w["length"], w["success"]) == (0, 4, 6, True)
    assert w["instruction"] == "lift the cube"
    with pytest.raises(IndexError):
        store.window(0, 6)


def test_window_dataset_matches_store_windows(tmp_path):
    s = random_store(tmp_path / "s", lengths=[5, 1, 8], cameras=CAMS)
    mem = WindowDataset(s, n_obs=2, horizon=3, n_future=2, in_memory=True)
    disk = WindowDataset(s, n_obs=2, horizon=3, n_future=2, in_memory=False)
    assert len(mem) == len(disk) == 14
    for k in range(len(mem)):
        e, t = mem.index_of(k)
        w = s.window(e, t, 2, 3, 2)
        for item in (mem[k], disk[k]):
            for key in ("proprio", "obs_pad", "actions", "action_pad", "rewards", "future_proprio", "future_pad"):
                assert isinstance(item[key], torch.Tensor)
                np.testing.assert_array_equal(item[key].numpy(), w[key], err_msg=f"{key} at {k}")
            for c in CAMS:
                np.testing.assert_array_equal(item["images"][c].numpy(), w["images"][c])
                np.testing.assert_array_equal(item["future_images"][c].numpy(), w["future_images"][c])
            assert int(item["episode"]) == e and int(item["step"]) == t and item["instruction"] == w["instruction"]
    b = mem.get_batch([0, 5, 13])
    assert b["images"]["agentview"].shape == (3, 2, 3, 8, 8) and b["actions"].shape == (3, 3, 7)
    assert b["episode"].tolist() == [0, 1, 2] and b["step"].tolist() == [0, 0, 7]
    assert b["action_pad"][1].tolist() == [False, True, True]
    loader = torch.utils.data.DataLoader(mem, batch_size=4)
    first = next(iter(loader))
    assert first["proprio"].shape == (4, 2, 9) and len(first["instruction"]) == 4
    sub = WindowDataset(s, n_obs=1, horizon=2, episodes=[2], cameras=[])
    assert len(sub) == 8 and sub[0]["images"] == {} and int(sub[0]["episode"]) == 2
    g = torch.Generator().manual_seed(0)
    assert mem.sample_batch(6, generator=g)["actions"].shape == (6, 3, 7)


def test_masked_loss_ignores_padded_targets(tmp_path):
    s = random_store(tmp_path / "s", lengths=[6, 9])
    ds = WindowDataset(s, n_obs=1, horizon=5)
    k = int(np.flatnonzero((ds._pos == 0) & (ds._t == 4))[0])  # window at the end of episode 0
    b = ds.get_batch([k, k + 1, 0])
    pad = b["action_pad"]
    assert pad[0].sum() == 3 and pad[1].sum() == 4 and not pad[2].any()
    pred = torch.randn(3, 5, 7, requires_grad=True)
    target = b["actions"]
    loss = masked_mse(pred, target, pad)
    (g0,) = torch.autograd.grad(loss, pred)
    for bad in (1e6, float("inf"), float("nan")):
        t2 = target.clone()
        t2[pad] = bad
        loss2 = masked_mse(pred, t2, pad)
        (g2,) = torch.autograd.grad(loss2, pred)
        assert torch.equal(loss, loss2), bad
        assert torch.equal(g0, g2), bad
    # and the loss does see the non-padded targets
    t3 = target.clone()
    t3[0, 0] += 1.0
    assert not torch.equal(loss, masked_mse(pred, t3, pad))
    # a plain mean over everything would not ignore them
    t4 = target.clone()
    t4[pad] = 1e6
    assert ((pred - t4) ** 2).mean() > 1e6 * loss
    assert masked_mse(pred, target, torch.ones(3, 5, dtype=torch.bool)).item() == 0.0


# ---------------------------------------------------------------------- crash safety
_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    import zarr
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.kernel.storage.synthetic import random_episode
    path, mode, T = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = EpisodeStore.open(path, mode="a")
    ep = random_episode(T, {"agentview": (64, 64), "robot0_eye_in_hand": (64, 64)}, seed=99)
    if mode == "pause":  # stop for good after the first arrays of the new episode are on disk
        orig = zarr.Group.create_array
        calls = [0]
        def create_array(self, *a, **k):
            out = orig(self, *a, **k)
            calls[0] += 1
            if calls[0] == 2:
                print("PARTIAL", flush=True)
                time.sleep(600)
            return out
        zarr.Group.create_array = create_array
    print("START", flush=True)
    store.append(ep)
    print("DONE", flush=True)
""")


def _spawn(path, mode, T):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(path), mode, str(T)], stdout=subprocess.PIPE,
                            text=True, env=env)


def _wait_for(proc, word, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        line = proc.stdout.readline()
        if word in line:
            return
        if line == "" and proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}) before printing {word}")
    raise AssertionError(f"child did not print {word}")


def _make_two(tmp_path):
    cams = {"agentview": (64, 64), "robot0_eye_in_hand": (64, 64)}
    s = EpisodeStore.create(tmp_path / "s", cameras=cams, state_dim=9, action_dim=7, fps=20,
                            action_space=PANDA_OSC_POSE)
    eps = [random_episode(T, cams, seed=i) for i, T in enumerate([7, 4])]
    for e in eps:
        s.append(e)
    return s, eps, cams


def test_sigkill_mid_append_keeps_earlier_episodes(tmp_path):
    s, eps, cams = _make_two(tmp_path)
    reader = EpisodeStore.open(s.path, mode="r")  # a reader open during the append
    proc = _spawn(s.path, "pause", 400)
    try:
        _wait_for(proc, "PARTIAL")
        assert (s.path / "episodes" / "ep_000002").is_dir()  # partial group of the killed writer
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    after = EpisodeStore.open(s.path, mode="r")
    assert len(after) == 2 and after.lengths.tolist() == [7, 4]
    for i, e in enumerate(eps):
        assert_episode_equal(after.episode(i), e)
        assert_episode_equal(reader.episode(i), e)
    assert len(reader.refresh()) == 2
    # a new append works, overwrites the orphan and is read back whole
    w = EpisodeStore.open(s.path, mode="a")
    new = random_episode(5, cams, seed=7)
    assert w.append(new) == 2
    assert_episode_equal(EpisodeStore.open(s.path).episode(2), new)
    assert len(reader) == 2
    assert reader.episode(2).length == 5  # a reader asking for a newer episode re-reads the index
    assert len(reader) == 3


def test_sigkill_at_a_random_moment_of_a_big_append(tmp_path):
    s, eps, cams = _make_two(tmp_path)
    proc = _spawn(s.path, "run", 3000)
    try:
        _wait_for(proc, "START")
        time.sleep(0.15)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    after = EpisodeStore.open(s.path, mode="a")
    assert len(after) in (2, 3)  # killed before or (rarely, on a fast disk) after the commit
    for i, e in enumerate(eps):
        assert_episode_equal(after.episode(i), e)
    if len(after) == 3:
        assert after.lengths[2] == 3000
    n = len(after)
    assert after.append(random_episode(3, cams, seed=5)) == n
    assert EpisodeStore.open(s.path).lengths[-1] == 3


_IMPORT_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from wmrl.run.import_data import write_store
    from wmrl.kernel.storage.synthetic import random_episode
    from wmrl.kernel.types import PANDA_OSC_POSE
    def episodes():
        yield random_episode(4, {}, seed=0)
        print("PARTIAL", flush=True)  # the first episode is in the partial store; never finish
        time.sleep(600)
        yield random_episode(4, {}, seed=1)
    kw = dict(cameras={}, state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE, durable=False)
    write_store(Path(sys.argv[1]), episodes(), kw, False)
""")


def test_a_killed_import_leaves_a_partial_folder_that_the_next_import_removes(tmp_path):
    """`wmrl import` builds `.<out>.partial-<pid>-<thread>` and renames it; a SIGKILL leaves the folder. The
    next import to the same out removes the partial folders of dead processes, not of live ones."""
    from wmrl.run.import_data import write_store

    out = tmp_path / "imported"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _IMPORT_CHILD, str(out)], stdout=subprocess.PIPE, text=True,
                            env=env)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _wait_for(proc, "PARTIAL")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        (killed,) = tmp_path.glob(f".imported.partial-{proc.pid}-*")
        assert killed.is_dir() and not out.exists()                   # what the kill leaves
        busy = tmp_path / f".imported.partial-{live.pid}-{live.pid}"   # another import still running
        busy.mkdir()
        dead = tmp_path / f".imported.partial-{2 ** 22 + 12345}"       # pid beyond pid_max: never running
        dead_thread = tmp_path / f".imported.partial-{2 ** 22 + 12345}-7"
        dead_thread.mkdir()
        dead.mkdir()
        other = tmp_path / f".other.partial-{2 ** 22 + 12345}"         # a partial of another out: not ours
        other.mkdir()
        eps = [random_episode(3, {}, seed=s) for s in (5, 6)]
        kw = dict(cameras={}, state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE, durable=False)
        lengths, _ = write_store(out, iter(eps), kw, False)
        assert lengths == [3, 3]
        assert not killed.exists() and not dead.exists() and not dead_thread.exists()
        assert busy.is_dir() and other.is_dir()
        back = EpisodeStore.open(out)
        for i, e in enumerate(eps):
            assert_episode_equal(back.episode(i), e)
    finally:
        for p in (proc, live):
            if p.poll() is None:
                p.kill()
                p.wait(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([busy.name, other.name, "imported"])


# ---------------------------------------------------------------------- bad input
def _bad(kind: str):
    e = random_episode(6, CAMS, seed=11)
    if kind == "action_dim":
        e.actions = np.zeros((6, 6), np.float32)
    elif kind == "state_dim":
        e.proprio = np.zeros((6, 8), np.float32)
    elif kind == "action_nan":
        e.actions[4, 2] = np.nan
    elif kind == "action_inf":
        e.actions[4, 0] = -np.inf
    elif kind == "proprio_inf":
        e.proprio[4, 1] = np.inf
    elif kind == "reward_nan":
        e.rewards[4] = np.nan
    elif kind == "image_dtype":
        e.images["agentview"] = e.images["agentview"].astype(np.float32) / 255
    elif kind == "image_shape":
        e.images["agentview"] = np.ascontiguousarray(e.images["agentview"].transpose(0, 2, 3, 1))
    elif kind == "missing_camera":
        del e.images["robot0_eye_in_hand"]
    elif kind == "extra_camera":
        e.images["frontview"] = e.images["agentview"]
    elif kind == "length_mismatch":
        e.proprio = e.proprio[:5]
    elif kind == "extras_length":
        e.extras = {"timestamp": np.zeros(5)}
    elif kind == "info_not_json":
        e.info = {"x": object()}
    elif kind == "empty":
        e = random_episode(1, CAMS)
        e.actions = e.actions[:0]
    return e


@pytest.mark.parametrize("kind,key,step,words", [
    ("action_dim", "actions", None, "action_dim=7"),
    ("state_dim", "proprio", None, "state_dim=9"),
    ("action_nan", "actions", 4, "non-finite"),
    ("action_inf", "actions", 4, "non-finite"),
    ("proprio_inf", "proprio", 4, "non-finite"),
    ("reward_nan", "rewards", 4, "non-finite"),
    ("image_dtype", "images/agentview", None, "uint8"),
    ("image_shape", "images/agentview", None, "channel-last"),
    ("missing_camera", "images", None, "missing ['robot0_eye_in_hand']"),
    ("extra_camera", "images", None, "unexpected ['frontview']"),
    ("length_mismatch", "proprio", None, "expected shape (6, 9)"),
    ("extras_length", "extras/timestamp", None, "leading dim T=6"),
    ("info_not_json", "info", None, "JSON"),
    ("empty", "actions", None, "no steps"),
])
def test_bad_episode_is_rejected_and_nothing_is_lost(store, kind, key, step, words):
    good = random_episode(4, CAMS, seed=1)
    store.append(good)
    with pytest.raises(EpisodeValidationError) as ei:
        store.append(_bad(kind))
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.episode == 1 and err.key == key and err.step == step
    assert words in str(err) and "episode 1" in str(err)
    if step is not None:
        assert f"step {step}" in str(err)
    assert len(store) == 1 and not (store.path / "episodes" / "ep_000001").exists()
    r = EpisodeStore.open(store.path)
    assert len(r) == 1
    assert_episode_equal(r.episode(0), good)
    assert store.append(random_episode(2, CAMS, seed=2)) == 1  # the store still takes good episodes


def test_store_level_errors(tmp_path, store):
    store.append(random_episode(3, CAMS))
    with pytest.raises(StoreError, match="already exists"):
        EpisodeStore.create(store.path, cameras=CAMS, state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE)
    assert len(EpisodeStore.open(store.path)) == 1
    with pytest.raises(StoreError, match="read-only"):
        EpisodeStore.open(store.path, mode="r").append(random_episode(3, CAMS))
    with pytest.raises(StoreError, match="no EpisodeStore"):
        EpisodeStore.open(tmp_path / "nope")
    with pytest.raises(StoreError, match="action_space.dim"):
        EpisodeStore.create(tmp_path / "x", cameras=CAMS, state_dim=9, action_dim=6, fps=20, action_space=PANDA_OSC_POSE)
    with pytest.raises(StoreError, match="mode"):
        EpisodeStore.open(store.path, mode="w")


def test_unknown_format_version_and_corrupt_index(store):
    store.append(random_episode(3, CAMS))
    zj = store.path / "zarr.json"
    original = zj.read_text()
    d = json.loads(original)
    d["attributes"]["wmrl"]["format_version"] = 99
    zj.write_text(json.dumps(d))
    with pytest.raises(StoreFormatError, match="format_version 99"):
        EpisodeStore.open(store.path)
    zj.write_text(original)
    assert len(EpisodeStore.open(store.path)) == 1
    idx = store.path / "index.json"
    good = idx.read_text()
    idx.write_text(good[: len(good) // 2])
    with pytest.raises(StoreFormatError, match="index.json is corrupt"):
        EpisodeStore.open(store.path)
    idx.write_text(good)
    assert len(EpisodeStore.open(store.path)) == 1


def test_open_or_create(tmp_path):
    kw = dict(cameras=CAMS, state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE)
    killed = tmp_path / f".s.creating-{2 ** 22 + 12345}"             # a creator killed mid-way (dead pid)
    killed.mkdir()
    s = EpisodeStore.open_or_create(tmp_path / "s", **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    with pytest.raises(StoreExistsError, match="already exists"):
        EpisodeStore.create(tmp_path / "s", **kw)
    s.append(random_episode(3, CAMS))
    s2 = EpisodeStore.open_or_create(tmp_path / "s", **kw)
    assert len(s2) == 1 and s2.mode == "a"
    with pytest.raises(StoreError, match="state_dim"):
        EpisodeStore.open_or_create(tmp_path / "s", **{**kw, "state_dim": 8})


RACE_PROCESSES, RACE_TRIALS = 8, 6


def _open_or_create_racer(barrier, paths, results, rank):
    """One of the processes racing `open_or_create` (module level: spawned processes import it). For
    each path it waits for all racers, then opens or creates the store and appends one episode."""
    asp = ActionSpace(dim=2, controller="JOINT_VELOCITY")
    for k, path in enumerate(paths):
        barrier.wait(120)
        try:
            s = EpisodeStore.open_or_create(path, cameras={}, state_dim=3, action_dim=2, fps=10, action_space=asp,
                                            durable=False)
            s.append(random_episode(2, {}, state_dim=3, action_dim=2, seed=rank))
            results.put((k, rank, "ok"))
        except Exception as e:  # noqa: BLE001 - the test reports every kind
            results.put((k, rank, f"{type(e).__module__}.{type(e).__name__}: {e}"))


def test_processes_racing_open_or_create_share_one_store(tmp_path):
    """8 processes call open_or_create on one new path at once (several trials): every one gets the
    same valid store, so their 8 appended episodes are all in it, and no temporary folder is left."""
    from fresh_procs import fresh_processes

    ctx = fresh_processes()
    barrier, results = ctx.Barrier(RACE_PROCESSES), ctx.Queue()
    paths = [str(tmp_path / f"s{k}") for k in range(RACE_TRIALS)]
    procs = [ctx.Process(target=_open_or_create_racer, args=(barrier, paths, results, r))
             for r in range(RACE_PROCESSES)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=300) for _ in range(RACE_PROCESSES * RACE_TRIALS)]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    failed = sorted({k for k, _, r in got if r != "ok"})
    assert not failed, (f"{len(failed)}/{RACE_TRIALS} trials failed: "
                        f"{sorted({r for _, _, r in got if r != 'ok'})[:4]}")
    for path in paths:
        s = EpisodeStore.open(path)
        assert len(s) == RACE_PROCESSES and s.lengths.tolist() == [2] * RACE_PROCESSES
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"s{k}" for k in range(RACE_TRIALS))


def test_threads_racing_open_or_create_share_one_store(tmp_path):
    """The same race between 8 threads of one process (each builds in its own temporary folder)."""
    import threading

    asp = ActionSpace(dim=2, controller="JOINT_VELOCITY")
    for k in range(RACE_TRIALS):
        barrier, errors = threading.Barrier(RACE_PROCESSES), []

        def racer(rank, path=tmp_path / f"s{k}", barrier=barrier, errors=errors):
            barrier.wait(60)
            try:
                s = EpisodeStore.open_or_create(path, cameras={}, state_dim=3, action_dim=2, fps=10,
                                                action_space=asp, durable=False)
                s.append(random_episode(2, {}, state_dim=3, action_dim=2, seed=rank))
            except Exception as e:  # noqa: BLE001 - the test reports every kind
                errors.append(f"{type(e).__module__}.{type(e).__name__}: {e}")

        threads = [threading.Thread(target=racer, args=(r,)) for r in range(RACE_PROCESSES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, f"trial {k}: {errors[:3]}"
        assert len(EpisodeStore.open(tmp_path / f"s{k}")) == RACE_PROCESSES
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"s{k}" for k in range(RACE_TRIALS))


def test_stats_from_store(tmp_path):
    s = random_store(tmp_path / "s", lengths=[5, 8])
    st = s.stats()
    acts = np.concatenate([s.episode(i).actions for i in range(2)])
    np.testing.assert_allclose(st.stats["actions"]["mean"], acts.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st.stats["actions"]["q99"], np.quantile(acts, 0.99, axis=0), rtol=1e-5, atol=1e-6)
    assert st.dim("proprio") == 9 and st.count["actions"] == 13
    only1 = s.stats(episodes=[1])
    np.testing.assert_allclose(only1.stats["proprio"]["max"], s.episode(1).proprio.max(0))
    assert only1.count["proprio"] == 8
    with pytest.raises(StoreError, match="no episodes"):
        s.stats(episodes=[])


def test_concurrent_appenders_are_serialised(tmp_path):
    """Separate store objects in separate threads (each lock is its own open file, as in separate
    processes) append at once; the append lock serialises them."""
    import threading

    s, eps, cams = _make_two(tmp_path)
    errors = []

    def worker(T):
        try:
            EpisodeStore.open(s.path, mode="a", durable=False).append(random_episode(T, cams, seed=T))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(T,)) for T in (30, 40, 50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    r = EpisodeStore.open(s.path)
    assert len(r) == 5
    assert r.lengths[:2].tolist() == [7, 4] and sorted(r.lengths[2:].tolist()) == [30, 40, 50]
    for i in range(5):
        assert r.episode(i).length == r.lengths[i]
    assert sorted(p.name for p in (s.path / "episodes").iterdir() if p.is_dir()) == [f"ep_{i:06d}" for i in range(5)]


def test_image_free_store_and_success_flag(tmp_path):
    s = EpisodeStore.create(tmp_path / "s", cameras={}, state_dim=3, action_dim=2, fps=10,
                            action_space=ActionSpace(dim=2, controller="JOINT_VELOCITY"), durable=False)
    e = random_episode(4, {}, state_dim=3, action_dim=2)
    assert s.append(e) == 0
    assert s.episode(0).images == {}
    w = s.window(0, 3, n_obs=2, horizon=2)
    assert w["images"] == {} and w["action_pad"].tolist() == [False, True]
    ds = WindowDataset(s, n_obs=2, horizon=2)
    assert ds.get_batch([0, 3])["actions"].shape == (2, 2, 2)
    e.success = "yes"
    with pytest.raises(EpisodeValidationError, match="success"):
        s.append(e)
    assert len(s) == 1


def test_missing_episode_group_is_reported(store):
    store.append(random_episode(3, CAMS))
    import shutil

    shutil.rmtree(store.path / "episodes" / "ep_000000")
    with pytest.raises(StoreFormatError, match="missing on disk"):
        EpisodeStore.open(store.path).episode(0)


def test_torch_tensors_and_numpy_info_are_accepted(store):
    e = random_episode(4, CAMS, seed=4)
    t = dataclasses.replace(
        e, images={c: torch.from_numpy(v) for c, v in e.images.items()}, proprio=torch.from_numpy(e.proprio),
        actions=torch.from_numpy(e.actions).double(), rewards=torch.from_numpy(e.rewards),
        success=torch.tensor(True), info={"seed": np.int64(4), "xy": np.array([1.5, 2.0])})
    assert store.append(t) == 0
    back = store.episode(0)
    assert back.actions.dtype == np.float32 and back.info == {"seed": 4, "xy": [1.5, 2.0]} and back.success is True
    np.testing.assert_array_equal(back.images["agentview"], e.images["agentview"])
    bad = dataclasses.replace(t, images={**t.images, "agentview": t.images["agentview"].float()})
    with pytest.raises(EpisodeValidationError, match="uint8"):
        store.append(bad)


def test_failed_write_leaves_no_partial_group(store, monkeypatch):
    store.append(random_episode(3, CAMS))
    import zarr

    def boom(self, *a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(zarr.Group, "create_array", boom)
    with pytest.raises(OSError, match="No space"):
        store.append(random_episode(3, CAMS, seed=1))
    monkeypatch.undo()
    assert len(EpisodeStore.open(store.path)) == 1
    assert not (store.path / "episodes" / "ep_000001").exists()
    assert store.append(random_episode(2, CAMS)) == 1
