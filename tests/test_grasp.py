"""worldmodels.grasp.GraspHead and the world model's finger-gap head: it starts as the dynamics, it
learns what only the camera shows, the world model trains it and uses it, bad settings are refused."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from wmrl.kernel.types import PANDA_OSC_POSE
from worldmodels.grasp import GraspHead


def _tiny_cfg(**extra):
    cfg = OmegaConf.to_container(OmegaConf.load("configs/worldmodel/tiny.yaml"))
    cfg.pop("_target_")
    return {**cfg, **extra}


def test_the_head_learns_from_the_image_what_the_arm_cannot_tell():
    """Fingers that stop at 4 cm when the wrist frame shows a cube (bright) and close to 0 otherwise:
    from the same proprio and actions only the image tells the two apart. The untrained head is the
    dynamics' prediction exactly; trained, it is far closer than the best blind guess."""
    torch.manual_seed(0)
    head = GraspHead(chunk_size=4, image_size=16, channels=(8, 8, 8, 8), hidden=32, dropout=0.0)
    b = 64
    cube = torch.rand(b) < 0.5
    frame = torch.where(cube[:, None, None, None], 0.8, -0.8) + 0.1 * torch.randn(b, 3, 16, 16)
    proprio = torch.zeros(b, 9)
    proprio[:, 7], proprio[:, 8] = 0.04, -0.04
    actions = torch.ones(b, 4, 7)
    predicted = proprio.clone()
    predicted[:, 7:9] = torch.tensor([0.01, -0.01])          # the blind dynamics: the mean of the two
    target = proprio.clone()
    target[:, 7] = torch.where(cube, 0.02, 0.0)
    target[:, 8] = -target[:, 7]
    assert torch.equal(head(frame, proprio, actions, predicted), predicted[:, 7:9])
    opt = torch.optim.Adam(head.parameters(), 3e-3)
    for _ in range(150):
        loss = head.loss(frame, proprio, actions, predicted, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    gap = lambda g: g[:, 0] - g[:, 1]   # noqa: E731
    err = (gap(head(frame, proprio, actions, predicted)) - gap(target[:, 7:9])).abs().mean()
    blind = (gap(predicted[:, 7:9]) - gap(target[:, 7:9])).abs().mean()
    assert blind == pytest.approx(0.02) and err < 0.2 * blind


def test_a_world_model_trains_its_grasp_head_and_imagines_with_it(tmp_path):
    from worldmodels.data import EpisodeFrames
    from worldmodels.synthetic import make_episodes
    from worldmodels.train import train_world_model
    from worldmodels.video_wm import ChunkFlowWorldModel, WMState

    dyn = {"action_space": PANDA_OSC_POSE.to_dict(), "ensemble": 2, "hidden": 16}
    cfg = _tiny_cfg(dynamics=dyn, grasp={"camera": "robot0_eye_in_hand", "channels": [8, 8, 8, 8], "hidden": 16})
    torch.manual_seed(0)
    wm = ChunkFlowWorldModel(**cfg)
    eps = make_episodes(4, length=24, size=32, seed=3)
    for e in eps:
        e.actions[:, -1] = -1.0
        e.actions[12:, -1] = 1.0
    frames = EpisodeFrames(eps, cameras=wm.cameras)
    w = frames.windows([0, 1], [9, 5], 4)
    state = WMState(w.frames.float() / 127.5 - 1, w.proprio, ["t", "t"], prev_proprio=w.prev_proprio)
    wm.set_norm_stats(torch.from_numpy(frames.proprio), torch.from_numpy(frames.proprio) * 0.1)
    wm.eval()
    untrained = wm.predict_proprio(state, w.actions)[0]
    ens = wm.dynamics.rollout(w.proprio, w.actions, w.prev_proprio).mean(0)[:, -1]
    assert torch.allclose(untrained[:, 7:9], ens[:, 7:9])          # starts as the dynamics
    before = {k: v.clone() for k, v in wm.grasp.state_dict().items()}
    rep = train_world_model(wm, cfg, frames, tmp_path, steps=3, batch_size=4, warmup=1, eval_every=1000,
                            checkpoint_every=0, progress=False, tensorboard=False,
                            dynamics={"batch_size": 8, "unroll_chunks": 2}, grasp={"batch_size": 8})
    assert rep["steps"] == 3 and not wm.training
    assert any(not torch.equal(before[k], v) for k, v in wm.grasp.state_dict().items())
    new, obs = wm.imagine(state, w.actions)
    head = wm.grasp(wm.grasp_frame(state.frames), state.proprio, w.actions,
                    wm.dynamics.rollout(w.proprio, w.actions, w.prev_proprio).mean(0)[:, -1])
    assert torch.allclose(new.proprio[:, 7:9], head) and torch.allclose(obs.proprio, new.proprio)


def test_gripper_switch_windows():
    from worldmodels.data import EpisodeFrames
    from worldmodels.synthetic import make_episodes

    eps = make_episodes(1, length=20, size=32, seed=4)
    eps[0].actions[:, -1] = -1.0
    eps[0].actions[6:12, -1] = 1.0         # closes at step 6, opens at 12
    data = EpisodeFrames(eps)
    e, t = data.gripper_switch_starts(4, closing_only=True)
    assert t.tolist() == [3, 4, 5, 6] and set(e.tolist()) == {0}
    _, t = data.gripper_switch_starts(4)
    assert t.tolist() == [3, 4, 5, 6, 9, 10, 11, 12]
    eps[0].actions[:, -1] = 1.0           # closed from the start: the first step is a close
    _, t = EpisodeFrames(eps).gripper_switch_starts(4)
    assert t.tolist() == [0]


def test_bad_grasp_settings_are_refused():
    from worldmodels.video_wm import ChunkFlowWorldModel

    with pytest.raises(ValueError, match="set dynamics as well"):
        ChunkFlowWorldModel(**_tiny_cfg(grasp={}))
    dyn = {"action_space": PANDA_OSC_POSE.to_dict(), "ensemble": 2, "hidden": 16}
    with pytest.raises(ValueError, match="not one of the model's cameras"):
        ChunkFlowWorldModel(**_tiny_cfg(dynamics=dyn, grasp={"camera": "frontview"}))
    with pytest.raises(ValueError, match="divisible by 16"):
        GraspHead(chunk_size=4, image_size=24)


def test_a_head_without_the_wrist_frame_reads_only_the_anchor_and_the_arm():
    """``wrist=False``: the imagined frame the policy also acts on does not move the head's call (a
    policy cannot close where an imagined frame merely looks like a grasp); the anchor frame does; a
    head that reads neither is refused."""
    torch.manual_seed(0)
    head = GraspHead(chunk_size=4, image_size=16, channels=(8, 8, 8, 8), hidden=32, dropout=0.0, anchor=True,
                     wrist=False)
    assert head.conv is None
    torch.nn.init.normal_(head.mlp[-1].weight, std=0.1)   # a trained head: its output depends on its inputs
    b = 5
    proprio, predicted = torch.zeros(b, 9), torch.zeros(b, 9)
    actions, anchor = torch.ones(b, 4, 7), torch.rand(b, 3, 16, 16) * 2 - 1
    out = head(torch.rand(b, 3, 16, 16), proprio, actions, predicted, anchor)
    assert torch.equal(out, head(None, proprio, actions, predicted, anchor))
    assert not torch.allclose(out, head(None, proprio, actions, predicted, -anchor))
    with pytest.raises(ValueError, match="must read an anchor frame"):
        GraspHead(chunk_size=4, image_size=16, wrist=False)


def test_an_anchor_head_trains_on_imagined_frames_and_keeps_the_real_start_frame(tmp_path):
    """With ``anchor_camera`` the head reads the rollout's real start frame: ``init`` keeps it in
    ``WMState.anchor`` and every imagined state carries it unchanged; training draws half of the
    head's windows with the model's own imagined start frame and an anchor from earlier in the
    episode, and the head learns."""
    from wmrl.kernel.types import Obs
    from worldmodels.data import EpisodeFrames
    from worldmodels.synthetic import make_episodes
    from worldmodels.train import train_world_model
    from worldmodels.video_wm import ChunkFlowWorldModel

    dyn = {"action_space": PANDA_OSC_POSE.to_dict(), "ensemble": 2, "hidden": 16, "gripper_speed": 0.2}
    cfg = _tiny_cfg(dynamics=dyn, grasp={"anchor_camera": "agentview", "channels": [8, 8, 8, 8], "hidden": 16})
    torch.manual_seed(0)
    wm = ChunkFlowWorldModel(**cfg)
    eps = make_episodes(4, length=24, size=32, seed=3)
    frames = EpisodeFrames(eps, cameras=wm.cameras)
    before = {k: v.clone() for k, v in wm.grasp.state_dict().items()}
    train_world_model(wm, cfg, frames, tmp_path, steps=3, batch_size=4, warmup=1, eval_every=1000, checkpoint_every=0,
                      progress=False, tensorboard=False, dynamics={"batch_size": 8, "unroll_chunks": 2},
                      grasp={"batch_size": 8, "imagined_fraction": 1.0})
    assert any(not torch.equal(before[k], v) for k, v in wm.grasp.state_dict().items())
    w = frames.windows([0, 1], [9, 5], 4)
    ctx = Obs({c: w.frames[:, 3 * i:3 * i + 3] for i, c in enumerate(wm.cameras)}, w.proprio, ["t", "t"])
    state = wm.init(ctx)
    assert torch.equal(state.anchor, state.frames) and state.gripper_command.shape == (2,)
    s1, _ = wm.imagine(state, w.actions)
    s2, _ = wm.imagine(s1, w.actions)
    assert torch.equal(s2.anchor, state.anchor) and not torch.equal(s2.frames, state.frames)
    with pytest.raises(ValueError, match="pass anchor"):
        wm.grasp(wm.grasp_frame(state.frames), state.proprio, w.actions, state.proprio)


def test_grasp_outcome_counts_misses_and_holds_from_the_real_fingers():
    """Two episodes close the gripper at step 4; in one the fingers stop on a cube (2.8 cm), in the
    other they close on nothing. A model whose fingers never move (an untrained dynamics ensemble)
    calls every hold right and no miss."""
    from worldmodels.data import EpisodeFrames
    from worldmodels.evaluate import grasp_outcome
    from worldmodels.synthetic import make_episodes
    from worldmodels.video_wm import ChunkFlowWorldModel

    dyn = {"action_space": PANDA_OSC_POSE.to_dict(), "ensemble": 2, "hidden": 16}
    wm = ChunkFlowWorldModel(**_tiny_cfg(dynamics=dyn)).eval()
    eps = make_episodes(2, length=24, size=32, seed=5)
    for e, final in zip(eps, (0.028, 0.0)):
        e.actions[:, -1] = -1.0
        e.actions[4:, -1] = 1.0
        e.proprio[:, 7], e.proprio[:, 8] = 0.04, -0.04
        e.proprio[6:, 7], e.proprio[6:, 8] = final / 2, -final / 2
    data = EpisodeFrames(eps, cameras=wm.cameras)
    wm.set_norm_stats(torch.from_numpy(data.proprio), torch.from_numpy(data.proprio) * 0.1 + 0.01)
    out = grasp_outcome(wm, data, chunks=2)
    assert out["n"] == 2 * 4 and out["misses"] == 4          # windows t = 1..4 contain the close
    assert out["hold_called"] == 1.0 and out["miss_called"] == 0.0 and len(out["gap_mae_m"]) == 2
    assert out["hold_precision"] == 0.5                       # every close called a hold, half of them misses
    assert grasp_outcome(wm, data, chunks=5)["n"] == 2 * 3    # H = 4: only t <= 3 can be followed 5 chunks (t + 20 <= 23)
    lead = grasp_outcome(wm, data, chunks=2, lead_chunks=1)   # imagined from a chunk before the close: t - 4 >= 0
    assert lead["n"] == 2 and lead["misses"] == 1 and lead["lead_chunks"] == 1 and len(lead["gap_mae_m"]) == 2
    assert lead["miss_called"] == 0.0 and lead["hold_called"] == 1.0
    assert grasp_outcome(wm, data, chunks=2, lead_chunks=2)["n"] == 0    # no close is 2 chunks into its episode
    with pytest.raises(ValueError, match="lead_chunks"):
        grasp_outcome(wm, data, lead_chunks=-1)


def test_retraining_the_grasp_head_alone_keeps_the_rest_of_the_world_model(tmp_path):
    """``retrain_grasp_head`` with ``wrist=False``: a new head (no wrist CNN) that learns, on a copy
    whose dynamics, frames and statistics are the trained model's own; the model given is unchanged
    and the copy round-trips through a checkpoint. A model without a grasp head is refused."""
    from wmrl.kernel.checkpoint import load_checkpoint, save_checkpoint
    from worldmodels.data import EpisodeFrames
    from worldmodels.synthetic import make_episodes
    from worldmodels.train import retrain_grasp_head, train_world_model
    from worldmodels.video_wm import ChunkFlowWorldModel

    dyn = {"action_space": PANDA_OSC_POSE.to_dict(), "ensemble": 2, "hidden": 16}
    cfg = _tiny_cfg(dynamics=dyn, grasp={"anchor_camera": "agentview", "channels": [8, 8, 8, 8], "hidden": 16})
    torch.manual_seed(0)
    wm = ChunkFlowWorldModel(**cfg)
    frames = EpisodeFrames(make_episodes(4, length=24, size=32, seed=3), cameras=wm.cameras)
    train_world_model(wm, cfg, frames, tmp_path / "wm", steps=2, batch_size=4, warmup=1, eval_every=1000,
                      checkpoint_every=0, progress=False, tensorboard=False, dynamics={"batch_size": 8},
                      grasp={"batch_size": 8})
    before = {k: v.clone() for k, v in wm.state_dict().items()}
    new, new_cfg = retrain_grasp_head(wm, cfg, frames, steps=4, head={"wrist": False}, grasp={"batch_size": 8},
                                      progress=False)
    assert all(torch.equal(before[k], v) for k, v in wm.state_dict().items())
    assert new_cfg["grasp"]["wrist"] is False and "wrist" not in cfg["grasp"]
    assert new.grasp.conv is None and not new.training
    keep = {k: v for k, v in wm.state_dict().items() if not k.startswith("grasp.")}
    assert all(torch.equal(v, new.state_dict()[k]) for k, v in keep.items())
    assert any(float(p.abs().sum()) > 0 for p in new.grasp.mlp[-1].parameters())   # the zero-initialised output learned
    save_checkpoint(new, tmp_path / "ck", new_cfg)
    back = load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in new.state_dict().items())
    with pytest.raises(ValueError, match="needs a world model with a grasp head"):
        retrain_grasp_head(ChunkFlowWorldModel(**_tiny_cfg(dynamics=dyn)), _tiny_cfg(dynamics=dyn), frames, steps=1)


def test_the_retrain_script_writes_a_checkpoint_and_compares_both_heads(tmp_path):
    """``scripts/retrain_grasp_head.py`` on a world-model checkpoint and its store: a loadable
    checkpoint with the new head's settings and a report with both heads' held-out grasp figures."""
    import importlib.util
    import json
    from pathlib import Path

    from wmrl.kernel.checkpoint import load_checkpoint, save_checkpoint
    from wmrl.kernel.storage import EpisodeStore
    from worldmodels.data import EpisodeFrames
    from worldmodels.synthetic import make_episode
    from worldmodels.train import fit_world_model_stats
    from worldmodels.video_wm import ChunkFlowWorldModel

    store = EpisodeStore.create(tmp_path / "store", cameras={"agentview": (32, 32), "robot0_eye_in_hand": (32, 32)},
                                state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE, durable=False)
    eps = []
    for i in range(5):
        e = make_episode(i, 24, 32, expert=True)
        e.actions[:, -1] = -1.0
        e.actions[10:, -1] = 1.0            # every episode closes the gripper at step 10
        store.append(e)
        eps.append(e)
    dyn = {"action_space": PANDA_OSC_POSE.to_dict(), "ensemble": 2, "hidden": 16}
    cfg = _tiny_cfg(dynamics=dyn, grasp={"anchor_camera": "agentview", "channels": [8, 8, 8, 8], "hidden": 16})
    wm = ChunkFlowWorldModel(**cfg)
    fit_world_model_stats(wm, EpisodeFrames(eps, cameras=wm.cameras))
    save_checkpoint(wm, tmp_path / "wm", cfg)
    path = Path(__file__).resolve().parents[1] / "scripts" / "retrain_grasp_head.py"
    spec = importlib.util.spec_from_file_location("retrain_grasp_head", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out"
    assert mod.main(["--world-model", str(tmp_path / "wm"), "--store", str(tmp_path / "store"), "--out", str(out),
                     "--no-wrist", "--steps", "2", "--heldout-every", "2"]) == 0
    new = load_checkpoint(out / "checkpoints" / "last")
    assert new.grasp.conv is None
    rep = json.loads((out / "report.json").read_text())
    assert rep["wrist"] is False and rep["steps"] == 2
    for k in ("old", "new"):
        assert rep[k]["grasp_outcome"]["n"] > 0 and set(rep[k]) == {"grasp_outcome", "grasp_outcome_lead"}
    with pytest.raises(SystemExit):
        mod.main(["--out", str(out)])          # neither --run nor --world-model with --store
