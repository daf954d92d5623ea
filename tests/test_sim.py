"""The Panda suite: init states, exact resets, upright cameras, chunk semantics, GL errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND, Start

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def suite():
    from sim.suite import Suite

    return Suite()


# ---------------------------------------------------------------------------- init states
def test_train_and_eval_init_states_are_disjoint_and_sized():
    from sim import init_states
    from sim.scenes import SCENES

    data = init_states.load()
    for scene in SCENES:
        train, ev = data[f"{scene}/train"], data[f"{scene}/eval"]
        assert ev.shape[0] == 50 and train.shape[0] >= 100
        assert ev.dtype == np.float64 and ev.shape[1] == train.shape[1]
        # no eval state equals a train state, nor do object positions nearly coincide
        obj_cols = slice(1 + 9, None)  # qpos after 7 arm + 2 finger joints
        d = np.abs(ev[:, None, obj_cols] - train[None, :, obj_cols]).max(-1)
        assert d.min() > 1e-4, f"{scene}: an eval init state coincides with a train init state"
        assert len({r.tobytes() for r in ev}) == 50 and len({r.tobytes() for r in train}) == len(train)


def test_init_states_regenerate_bitwise():
    """The stored file is what ``sim.init_states`` generates (spot check)."""
    from sim import init_states
    from sim.env import TaskEnv
    from sim.tasks import sample_layout

    for scene in ("two_cubes", "cube_target"):
        env = TaskEnv(scene, cameras=())
        for split, i in (("train", 5), ("eval", 49)):
            state = init_states.build_state(env, sample_layout(scene, init_states.layout_rng(scene, split, i)))
            assert np.array_equal(state, init_states.get(scene, split, i))


def test_init_state_errors_are_clear(suite):
    with pytest.raises(ValueError, match="out of range.*50 eval"):
        suite.init_state("lift_red", "eval", 50)
    with pytest.raises(ValueError, match="split must be"):
        suite.init_state("lift_red", "test", 0)
    with pytest.raises(ValueError, match="unknown task"):
        from sim.suite import Suite

        Suite(tasks=["open_the_drawer"])


# ---------------------------------------------------------------------------- resets
def test_reset_is_exact_whatever_came_before(suite):
    env = suite.make_env(1, cameras=())
    rng = np.random.default_rng(0)
    acts = torch.from_numpy(rng.uniform(-1, 1, (1, 12, 7)).astype(np.float32))

    def run(j):
        env.reset([suite.eval_start("stack_red_on_green", j)])
        s0 = env.sim_state(0)
        env.step(acts)
        return s0, env.sim_state(0)

    a0, a1 = run(7)
    b0, b1 = run(3)
    c0, c1 = run(7)
    assert np.array_equal(a0, c0) and np.array_equal(a1, c1)  # bitwise, start and after 12 steps
    assert not np.array_equal(a0, b0)
    assert np.array_equal(a0, suite.init_state("stack_red_on_green", "eval", 7))


# ---------------------------------------------------------------------------- cameras
def _place_in_view(task_env, camera, cam_xy):
    """Put the red cube at a point the camera sees at normalised image coords ``cam_xy``
    (x right, y up, in [-1, 1]), in front of it (12 cm for the wrist camera, above the table)."""
    import mujoco

    m, d = task_env.model, task_env.data
    cid = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_CAMERA, camera)
    t = np.tan(np.deg2rad(m.cam_fovy[cid]) / 2)
    depth = 0.12 if camera == EYE_IN_HAND else 0.35
    p_cam = np.array([cam_xy[0] * t * depth, cam_xy[1] * t * depth, -depth])  # MuJoCo camera looks along -z
    p = d.cam_xpos[cid] + d.cam_xmat[cid].reshape(3, 3) @ p_cam
    jnt = task_env.rs.objects["red"].joints[0]
    task_env.sim.data.set_joint_qpos(jnt, np.concatenate([p, [1, 0, 0, 0]]))
    mujoco.mj_forward(m, d)


@pytest.mark.parametrize("camera", [AGENTVIEW, EYE_IN_HAND])
def test_camera_frames_are_upright(suite, camera):
    from sim.env import TaskEnv

    env = TaskEnv("two_cubes", cameras=(camera,), image_size=(64, 64))
    env.reset("lift_red", suite.init_state("lift_red", "eval", 0))
    for x, y in ((0.5, 0.5), (-0.5, -0.5)):
        _place_in_view(env, camera, (x, y))
        img = env.observe()["images"][camera]
        assert img.dtype == np.uint8 and img.shape == (3, 64, 64)
        r, g, b = (img[i].astype(int) for i in range(3))
        red = (r > 120) & (g < 80) & (b < 80)
        assert red.sum() > 5, f"red cube not visible in {camera}"
        rows, cols = np.nonzero(red)
        # y up in the camera frame -> top rows of an upright image; x right -> right columns
        assert (rows.mean() < 32) == (y > 0), f"{camera} frame is upside down"
        assert (cols.mean() > 32) == (x > 0), f"{camera} frame is mirrored"


def test_observation_layout_and_shared_scene(suite):
    env = suite.make_env(2)
    obs = env.reset([suite.eval_start("lift_red", 4), suite.eval_start("lift_green", 4)])
    obs.validate()
    assert set(obs.images) == {AGENTVIEW, EYE_IN_HAND}
    assert obs.images[AGENTVIEW].shape == (2, 3, 64, 64)
    assert obs.proprio.shape == (2, 9) and obs.proprio.dtype == torch.float32
    assert torch.allclose(obs.proprio[:, 3:7].norm(dim=1), torch.ones(2), atol=1e-5)  # quat_wxyz
    assert obs.task == ["lift the red cube", "lift the green cube"]
    # same scene and init state: only the instruction tells the two tasks apart
    for cam in obs.images:
        assert torch.equal(obs.images[cam][0], obs.images[cam][1])
    assert torch.equal(obs.proprio[0], obs.proprio[1])


def test_render_settings_are_validated():
    from sim.render import RenderSettings

    assert RenderSettings.from_any({"shadows": 1}).shadows is True
    with pytest.raises(ValueError, match="unknown render setting"):
        RenderSettings.from_any({"shadow": True})


# ---------------------------------------------------------------------------- chunk semantics
def _lifted_state(suite, j=0):
    """Eval state ``j`` of two_cubes with the red cube held 10 cm up (lift succeeds at step 1)."""
    from sim.env import TaskEnv

    env = TaskEnv("two_cubes", cameras=())
    env.reset("lift_red", suite.init_state("lift_red", "eval", j))
    jnt = env.rs.objects["red"].joints[0]
    q = env.sim.data.get_joint_qpos(jnt).copy()
    q[2] += 0.10
    env.sim.data.set_joint_qpos(jnt, q)
    env.sim.forward()
    return env.sim_state()


def test_success_inside_a_chunk_stops_the_slot_and_auto_resets_only_it(suite):
    env = suite.make_env(2, auto_reset=True)
    lifted = _lifted_state(suite)
    starts = [Start("lift_red", "lift the red cube", sim_state=lifted), suite.eval_start("lift_red", 1)]
    obs0 = env.reset(starts)
    res = env.step(torch.zeros(2, 5, 7))
    assert res.steps_executed.tolist() == [1, 5]
    assert res.success.tolist() == [True, False]
    assert res.terminated.tolist() == [True, False] and res.truncated.tolist() == [False, False]
    assert res.done.tolist() == [True, False]
    assert res.reward.tolist() == [1.0, 0.0]  # the reward of the stopping step is kept
    # slot 0 was reset to its start, slot 1 continued
    assert env.elapsed(0) == 0 and env.elapsed(1) == 5
    assert torch.equal(res.obs.images[AGENTVIEW][0], obs0.images[AGENTVIEW][0])
    assert not torch.equal(res.info["final_obs"].images[AGENTVIEW][0], obs0.images[AGENTVIEW][0])
    assert res.info["episode_length"].tolist() == [1, 5]


def test_truncation_and_no_auto_reset(suite):
    env = suite.make_env(2, auto_reset=False, cameras=())
    lifted = _lifted_state(suite)
    env.reset([Start("lift_red", "", sim_state=lifted), suite.eval_start("lift_red", 2)])
    res = env.step(torch.zeros(2, 7, 7))
    assert res.steps_executed.tolist() == [1, 7]
    state0 = env.sim_state(0)
    total = 7
    while True:
        res = env.step(torch.zeros(2, 7, 7))
        assert res.steps_executed[0] == 0 and bool(res.info["finished"][0])  # finished slot does nothing
        assert np.array_equal(env.sim_state(0), state0)
        total += int(res.steps_executed[1])
        if res.truncated[1]:
            break
    assert total == 100 and int(res.steps_executed[1]) == 100 - 14 * 7  # stopped at the step limit
    assert not res.terminated[1] and not res.success[1]
    obs = env.reset_slots([1], [suite.eval_start("lift_red", 3)])
    assert env.elapsed(1) == 0 and obs.batch_size == 2


def test_bad_actions_raise(suite):
    env = suite.make_env(2, cameras=())
    env.reset([suite.eval_start("lift_red", 0)] * 2)
    for bad in (torch.zeros(2, 7), torch.zeros(3, 4, 7), torch.zeros(2, 4, 6), torch.zeros(2, 0, 7)):
        with pytest.raises(ValueError, match="expects actions"):
            env.step(bad)
    with pytest.raises(ValueError, match="non-finite"):
        env.step(torch.full((2, 1, 7), float("nan")))
    with pytest.raises(ValueError, match="2 starts"):
        env.reset([suite.eval_start("lift_red", 0)])


# ---------------------------------------------------------------------------- experts
def test_expert_is_deterministic_given_seed(suite):
    from sim.env import TaskEnv
    from sim.expert import ScriptedExpert

    env = TaskEnv("two_cubes", cameras=())

    def actions(seed, noise, n=30):
        env.reset("lift_red", suite.init_state("lift_red", "train", 0))
        ex = ScriptedExpert("lift_red", noise, seed)
        out = []
        for _ in range(n):
            a = ex.act(env.privileged())
            env.step(a)
            out.append(a)
        return np.stack(out)

    a = actions(1, 0.5)
    assert np.array_equal(a, actions(1, 0.5))
    assert not np.allclose(a, actions(2, 0.5))
    assert np.abs(a).max() <= 1.0 and a.dtype == np.float32
    with pytest.raises(ValueError, match="noise"):
        ScriptedExpert("lift_red", -1.0)


def test_expert_rotation_noise_scales_only_the_rotation_dims(suite):
    """Same state, same seed: the deviation from the clean expert's action on the rotation dims
    scales with ``rotation_noise`` (0 removes it), the position dims' deviation does not change."""
    from sim.env import TaskEnv
    from sim.expert import ScriptedExpert

    env = TaskEnv("two_cubes", cameras=())
    env.reset("lift_red", suite.init_state("lift_red", "train", 0))
    s = env.privileged()
    clean = ScriptedExpert("lift_red", 0.0, 3).act(s)
    dev = {r: ScriptedExpert("lift_red", 0.3, 3, rotation_noise=r).act(s) - clean for r in (1.0, 0.5, 0.0)}
    free = np.abs(clean[3:6] + dev[1.0][3:6]) < 1.0 - 1e-6      # rotation dims the [-1, 1] clip left alone
    assert free.sum() >= 2 and np.abs(dev[1.0][3:6][free]).min() > 1e-3
    np.testing.assert_allclose(dev[0.5][3:6][free], 0.5 * dev[1.0][3:6][free], atol=1e-6)
    np.testing.assert_allclose(dev[0.0][3:6], 0.0, atol=1e-7)
    np.testing.assert_allclose(dev[0.0][:3], dev[1.0][:3], atol=1e-7)
    np.testing.assert_allclose(ScriptedExpert("lift_red", 0.3, 3).act(s), dev[1.0] + clean, atol=1e-6)  # 1.0: the default
    with pytest.raises(ValueError, match="rotation_noise"):
        ScriptedExpert("lift_red", 0.3, 3, rotation_noise=-0.1)


@pytest.mark.parametrize("task", ["lift_green", "stack_red_on_green", "push_red_to_target"])
def test_clean_expert_solves_an_episode(suite, task):
    from sim.env import TaskEnv
    from sim.expert import ScriptedExpert

    env = TaskEnv(suite.task(task).scene, cameras=())
    env.reset(task, suite.init_state(task, "eval", 1))
    ex = ScriptedExpert(task, 0.0, 0)
    while True:
        _, success, te, tr = env.step(ex.act(env.privileged()))
        if te or tr:
            break
    assert success


# ---------------------------------------------------------------------------- GL
def test_import_needs_no_gl_and_bad_backend_names_mujoco_gl():
    code = textwrap.dedent("""
        import sys
        import sim, sim.env, sim.suite, sim.render
        assert "mujoco" not in sys.modules and "OpenGL" not in sys.modules, "import created GL state"
        from sim.env import TaskEnv
        from sim.suite import Suite
        s = Suite()
        env = TaskEnv("two_cubes", cameras=())          # physics works without any GL
        env.reset("lift_red", s.init_state("lift_red", "eval", 0))
        env.step([0, 0, 0, 0, 0, 0, -1])
        try:
            env.render("agentview")
        except RuntimeError as e:
            print("ERROR:", e)
        else:
            print("rendered")
    """)
    envv = dict(os.environ, MUJOCO_GL="bogus_backend")
    envv.pop("PYOPENGL_PLATFORM", None)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=envv, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith(("ERROR:", "rendered"))][-1]
    assert line.startswith("ERROR:")
    assert "MUJOCO_GL" in line and "bogus_backend" in line
    assert "egl" in line and "osmesa" in line  # names the backends


def test_robosuite_messages_print_once_and_import_noise_is_dropped():
    """robosuite's logger had its own console handler and propagated to the root (Hydra's) handlers:
    every message printed twice, and its import warnings about other robots' packages on every run."""
    code = textwrap.dedent("""
        import logging
        logging.basicConfig(level=logging.INFO, format="ROOT %(name)s %(message)s")
        from sim import _backend
        _backend.robosuite()
        lg = logging.getLogger("robosuite_logs")
        lg.warning("controller gains out of range")
        print("handlers", [type(h).__name__ for h in lg.handlers], "propagate", lg.propagate)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, MUJOCO_GL="egl"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert out.count("controller gains out of range") == 1, out      # once, through the root handlers
    assert "ROOT robosuite_logs controller gains out of range" in out
    assert "handlers [] propagate True" in out
    for noise in ("robosuite_models", "mink-based", "private macro file", "setup_macros", "OpenGL_accelerate"):
        assert noise not in out, out


def test_push_target_is_drawn_on_the_table(suite):
    from sim.env import TaskEnv

    env = TaskEnv("cube_target", cameras=(AGENTVIEW,), image_size=(64, 64))
    env.reset("push_red_to_target", suite.init_state("push_red_to_target", "eval", 0))
    s = env.privileged()
    assert abs(s["objects"]["target"]["pos"][2] - 0.8) < 0.005  # on the table top
    img = env.observe()["images"][AGENTVIEW].astype(int)
    green = (img[1] > 120) & (img[0] < 80) & (img[2] < 100)
    assert green.sum() > 10


def test_frames_do_not_depend_on_what_other_scenes_rendered(suite):
    """Scenes share one GL context: a frame must be the same before and after another scene drew."""
    from sim.env import TaskEnv

    a = TaskEnv("two_cubes", cameras=(AGENTVIEW, EYE_IN_HAND), image_size=(32, 32))
    b = TaskEnv("cube_target", cameras=(AGENTVIEW, EYE_IN_HAND), image_size=(48, 48))
    a.reset("lift_red", suite.init_state("lift_red", "eval", 0))
    b.reset("push_red_to_target", suite.init_state("push_red_to_target", "eval", 0))
    first = a.observe()["images"]
    b.observe()
    again = a.observe()["images"]
    for cam in first:
        assert np.array_equal(first[cam], again[cam])


def test_object_position_is_the_task_objects_place_in_the_base_frame(suite):
    """``Suite.object_position`` (the grasp box's start-state perception): the task's own object,
    in the frame of proprio's end effector, from a start's init state or its sim_state."""
    from sim.env import TaskEnv

    env = TaskEnv("two_cubes", cameras=())
    for task, obj in (("lift_red", "red"), ("lift_green", "green"), ("stack_red_on_green", "red")):
        state = suite.init_state(task, "train", 3)
        env.reset(task, state)
        pv = env.privileged()
        want = pv["base_mat"].T @ (pv["objects"][obj]["pos"] - pv["base_pos"])
        got = suite.object_position(Start(task_name=task, instruction="", init_index=3, split="train"))
        np.testing.assert_allclose(got, want, atol=1e-9)
        got = suite.object_position(Start(task_name=task, instruction="", sim_state=state))
        np.testing.assert_allclose(got, want, atol=1e-9)
    # the cubes sit on the table in front of the robot (robot base frame, m)
    assert 0.3 < want[0] < 0.8 and abs(want[1]) < 0.3
    assert suite.object_position(Start(task_name="lift_red", instruction="")) is None
    with pytest.raises(ValueError, match="shape"):
        suite.object_position(Start(task_name="lift_red", instruction="", sim_state=np.zeros(3)))


def test_goal_position_is_the_goal_objects_place_in_the_base_frame(suite):
    """``Suite.goal_position`` (the place box's start-state perception): stacking's goal, the green
    cube, read as ``object_position`` reads the task object; a task without a goal gives ``None``."""
    from sim.env import TaskEnv

    env = TaskEnv("two_cubes", cameras=())
    state = suite.init_state("stack_red_on_green", "train", 2)
    env.reset("stack_red_on_green", state)
    pv = env.privileged()
    want = pv["base_mat"].T @ (pv["objects"]["green"]["pos"] - pv["base_pos"])
    for start in (Start(task_name="stack_red_on_green", instruction="", init_index=2, split="train"),
                  Start(task_name="stack_red_on_green", instruction="", sim_state=state)):
        np.testing.assert_allclose(suite.goal_position(start), want, atol=1e-9)
    red = suite.object_position(Start(task_name="stack_red_on_green", instruction="", sim_state=state))
    assert np.linalg.norm(red[:2] - want[:2]) >= 0.09          # the layout keeps the cubes 9 cm apart
    assert suite.goal_position(Start(task_name="lift_red", instruction="", sim_state=state)) is None


def test_a_place_box_needs_a_suite_that_locates_goals(suite):
    from wmrl.kernel.interfaces import GoalLocatingSuite
    from wmrl.run.builders import with_suite

    opts = {"proprio_success": {"tasks": ["lift_red"], "release_tasks": ["stack_red_on_green"],
                                "place_box_m": [0.015, 0.02, 0.08]}}
    assert isinstance(suite, GoalLocatingSuite)
    out = with_suite(opts, suite)
    assert out["start_goals"] == suite.goal_position and "start_objects" not in out   # the box reads the goal only

    class Objects:       # locates task objects, not goals
        def object_position(self, start):
            return None

    with pytest.raises(ValueError, match="place_box_m=null"):
        with_suite({**opts, "task_step_limits": False}, Objects())
    assert "start_goals" not in with_suite({"proprio_success": {"tasks": ["lift_red"], "grasp_box_m": [0.03] * 3}}, suite)


def test_a_grasp_box_needs_a_suite_that_locates_objects(suite):
    from wmrl.kernel.interfaces import ObjectLocatingSuite
    from wmrl.run.builders import with_suite

    opts = {"proprio_success": {"tasks": ["lift_red"], "grasp_box_m": [0.035, 0.03, 0.02]}}
    assert isinstance(suite, ObjectLocatingSuite)
    assert with_suite(opts, suite)["start_objects"] == suite.object_position
    assert with_suite(opts, suite)["max_steps"] == suite.max_steps          # the tasks' step limits
    assert "max_steps" not in with_suite({"task_step_limits": False}, suite)
    assert "start_objects" not in with_suite({"proprio_success": {"tasks": ["lift_red"]}}, suite)
    with pytest.raises(ValueError, match="grasp_box_m=null"):
        with_suite({**opts, "task_step_limits": False}, object())
