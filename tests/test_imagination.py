"""ImaginationEnv keeps SimEnv's ChunkEnv semantics; keyframe starts come from stored episodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from wmrl.imagination import ImaginationEnv, start_obs
from wmrl.kernel.interfaces import ChunkEnv
from wmrl.kernel.types import PANDA_OSC_POSE, Obs, Start
from wmrl.rl.starts import starts_from_store
from worldmodels.synthetic import make_episodes


class CounterWorldModel:
    """Fake world model: every pixel of a slot holds a level; a chunk adds the sum of its actions'
    first dimension. Explicit state = the observation itself."""

    chunk_size = 4
    action_dim = 7
    context_frames = 1

    def init(self, context: Obs) -> Obs:
        return context

    def imagine(self, state: Obs, actions, generator=None):
        inc = actions[:, :, 0].sum(1).round().to(torch.int16)
        imgs = {k: (v.to(torch.int16) + inc[:, None, None, None]).clamp(0, 255).to(torch.uint8)
                for k, v in state.images.items()}
        new = Obs(imgs, state.proprio + 1, list(state.task))
        return new, new


class LevelCritic:
    """progress = level / 100; success when level >= 100."""

    def progress(self, obs: Obs) -> torch.Tensor:
        return obs.images["agentview"][:, 0, 0, 0].float() / 100

    def success_prob(self, obs: Obs) -> torch.Tensor:
        return (obs.images["agentview"][:, 0, 0, 0] >= 100).float()

    def evaluate(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.progress(obs), self.success_prob(obs)


def level_start(level: int, task: str = "t") -> Start:
    img = torch.full((1, 3, 4, 4), level, dtype=torch.uint8)
    return Start(task_name=task, instruction=f"do {task}",
                 context=Obs({"agentview": img, "robot0_eye_in_hand": img.clone()}, torch.zeros(1, 9), [f"do {task}"]))


def chunk(levels_per_step: list[float]) -> torch.Tensor:
    a = torch.zeros(len(levels_per_step), 4, 7)
    a[:, :, 0] = torch.tensor(levels_per_step)[:, None] / 4
    return a


def test_is_a_chunk_env_and_validates_input():
    env = ImaginationEnv(CounterWorldModel(), LevelCritic(), num_envs=2, max_chunks=3)
    assert isinstance(env, ChunkEnv)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(chunk([0, 0]))
    with pytest.raises(ValueError, match="2 starts"):
        env.reset([level_start(0)])
    with pytest.raises(ValueError, match="context"):
        env.reset([level_start(0), Start(task_name="x", instruction="x")])
    env.reset([level_start(0), level_start(0)])
    with pytest.raises(ValueError, match="H=4"):
        env.step(torch.zeros(2, 8, 7))
    with pytest.raises(ValueError, match="shape"):
        env.step(torch.zeros(3, 4, 7))
    with pytest.raises(ValueError, match="non-finite"):
        env.step(torch.full((2, 4, 7), float("nan")))


def test_reward_termination_truncation_and_partial_auto_reset():
    env = ImaginationEnv(CounterWorldModel(), LevelCritic(), num_envs=3, max_chunks=2, success_bonus=5.0)
    obs = env.reset([level_start(60, "a"), level_start(0, "b"), level_start(10, "c")])
    assert obs.images["agentview"][:, 0, 0, 0].tolist() == [60, 0, 10]
    r1 = env.step(chunk([40, 20, 0]))           # slot 0 reaches 100 -> success
    assert r1.terminated.tolist() == [True, False, False]
    assert r1.truncated.tolist() == [False, False, False]
    assert r1.success.tolist() == [True, False, False]
    assert r1.reward.tolist() == pytest.approx([0.4 + 5.0, 0.2, 0.0])
    assert r1.steps_executed.tolist() == [4, 4, 4]
    # only slot 0 was reset (to its start); final_obs keeps the pre-reset frame
    assert r1.info["final_obs"].images["agentview"][:, 0, 0, 0].tolist() == [100, 20, 10]
    assert r1.obs.images["agentview"][:, 0, 0, 0].tolist() == [60, 20, 10]
    assert r1.obs.task == ["do a", "do b", "do c"]
    r2 = env.step(chunk([0, 10, 0]))            # slots 1, 2 hit the chunk limit (2 chunks)
    assert r2.terminated.tolist() == [False, False, False]
    assert r2.truncated.tolist() == [False, True, True]
    assert r2.reward.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert r2.obs.images["agentview"][:, 0, 0, 0].tolist() == [60, 0, 10]
    r3 = env.step(chunk([0, 0, 0]))             # slot 0: its second chunk since its reset
    assert r3.truncated.tolist() == [True, False, False]


def test_success_patience_needs_consecutive_success_chunks():
    env = ImaginationEnv(CounterWorldModel(), LevelCritic(), num_envs=2, max_chunks=6, success_bonus=5.0,
                         success_patience=2, auto_reset=False)
    env.reset([level_start(60, "a"), level_start(60, "b")])
    r1 = env.step(chunk([40, 40]))              # both reach 100: one success chunk is not enough
    assert r1.success.tolist() == [False, False] and r1.terminated.tolist() == [False, False]
    assert r1.reward.tolist() == pytest.approx([0.4, 0.4])
    r2 = env.step(chunk([0, -40]))              # slot 0 stays up (success), slot 1 drops: streak broken
    assert r2.success.tolist() == [True, False] and r2.terminated.tolist() == [True, False]
    assert r2.reward.tolist() == pytest.approx([5.0, -0.4])
    r3 = env.step(chunk([0, 40]))               # slot 1 back up: its streak restarts at 1
    assert r3.success.tolist() == [False, False]
    r4 = env.step(chunk([0, 0]))
    assert r4.success.tolist() == [False, True]
    with pytest.raises(ValueError, match="success_patience"):
        ImaginationEnv(CounterWorldModel(), LevelCritic(), num_envs=1, success_patience=0)


def test_without_auto_reset_finished_slots_stay_finished():
    env = ImaginationEnv(CounterWorldModel(), LevelCritic(), num_envs=2, max_chunks=5, auto_reset=False)
    env.reset([level_start(90), level_start(0)])
    r1 = env.step(chunk([20, 4]))
    assert r1.terminated.tolist() == [True, False]
    r2 = env.step(chunk([20, 4]))
    assert r2.info["finished"].tolist() == [True, False]
    assert r2.steps_executed.tolist() == [0, 4]
    assert r2.reward.tolist() == pytest.approx([0.0, 0.04])
    assert r2.terminated.tolist() == [False, False]
    assert r2.obs.images["agentview"][:, 0, 0, 0].tolist() == [110, 8]   # slot 0 frozen
    obs = env.reset_slots([0], [level_start(5)])
    assert obs.images["agentview"][:, 0, 0, 0].tolist() == [5, 8]
    assert env.step(chunk([1, 1])).steps_executed.tolist() == [4, 4]


def test_next_start_is_used_for_auto_reset():
    env = ImaginationEnv(CounterWorldModel(), LevelCritic(), num_envs=1, max_chunks=1,
                         next_start=lambda slot: level_start(33))
    env.reset([level_start(0)])
    r = env.step(chunk([1]))
    assert r.truncated.tolist() == [True]
    assert r.obs.images["agentview"][0, 0, 0, 0] == 33


def test_keyframe_starts_from_store(tmp_path):
    from wmrl.kernel.storage import EpisodeStore

    store = EpisodeStore.create(tmp_path / "s", cameras={"agentview": (32, 32), "robot0_eye_in_hand": (32, 32)},
                                state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE, embodiment="toy",
                                source="synthetic")
    eps = make_episodes(3, length=20, size=32, seed=5)
    for e in eps:
        store.append(e)
    starts = starts_from_store(store, 40, np.random.default_rng(0), episodes=[0, 2], min_steps_left=8, context=2)
    assert {s.episode for s in starts} <= {0, 2}
    steps = [s.step for s in starts]
    assert max(steps) < 12 and min(steps) >= 0 and len(set(steps)) > 3   # any step, not only the first
    for s in starts:
        ep = eps[s.episode]
        assert s.context.batch_size == 2
        o = start_obs(s)
        assert torch.equal(o.images["agentview"][0], torch.from_numpy(ep.images["agentview"][s.step]))
        assert torch.allclose(o.proprio[0], torch.from_numpy(ep.proprio[s.step]))
        assert s.instruction == ep.instruction


def test_keyframe_starts_first_steps_only(tmp_path):
    """first_steps=1: every start is a stored episode's first frame (LIBERO's GRPO starts, no sim)."""
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.rl.starts import KeyframeStarts

    store = EpisodeStore.create(tmp_path / "s", cameras={"agentview": (32, 32), "robot0_eye_in_hand": (32, 32)},
                                state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE, embodiment="toy",
                                source="synthetic")
    eps = make_episodes(3, length=20, size=32, seed=5)
    for e in eps:
        store.append(e)
    starts = starts_from_store(store, 30, np.random.default_rng(0), first_steps=1)
    assert {s.step for s in starts} == {0} and len({s.episode for s in starts}) == 3
    for s in starts:
        assert torch.equal(start_obs(s).images["agentview"][0], torch.from_numpy(eps[s.episode].images["agentview"][0]))
    few = starts_from_store(store, 60, np.random.default_rng(1), first_steps=3)
    assert {s.step for s in few} == {0, 1, 2}
    ks = KeyframeStarts(tmp_path / "s", {t: t for t in set(store.task_names)}, per_task=2, seed=0, first_steps=1)
    assert {s.step for s in ks(0)} == {0}
    with pytest.raises(ValueError, match="first_steps"):
        starts_from_store(store, 1, np.random.default_rng(0), first_steps=0)


def test_keyframe_start_provider_per_task_and_reproducible(tmp_path):
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.rl.starts import KeyframeStarts, MixedStarts

    store = EpisodeStore.create(tmp_path / "s", cameras={"agentview": (32, 32), "robot0_eye_in_hand": (32, 32)},
                                state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE, embodiment="toy",
                                source="synthetic")
    for e in make_episodes(4, length=20, size=32, seed=6):
        store.append(e)
    names = store.task_names
    tasks = {t: t for t in sorted(set(names))}
    ks = KeyframeStarts(tmp_path / "s", tasks, per_task=3, seed=1)
    a, b, c = ks(0), ks(0), ks(1)
    assert len(a) == 3 * len(tasks)
    assert [(s.episode, s.step) for s in a] == [(s.episode, s.step) for s in b]
    assert [(s.episode, s.step) for s in a] != [(s.episode, s.step) for s in c]
    assert all(names[s.episode] == s.task_name and s.context is not None for s in a)
    assert len(MixedStarts(ks, None, ks)(0)) == 2 * len(a)
    with pytest.raises(ValueError, match="no episodes of tasks"):
        KeyframeStarts(tmp_path / "s", {"missing_task": "x"}, per_task=1)


def test_with_learned_models_runs_grpo_rollouts(tmp_path):
    """The real world model + critic (untrained, tiny) drive wmrl.rl.rollout.rollout_batch."""
    from wmrl.kernel.types import PolicySample
    from wmrl.rl.rollout import rollout_batch

    wm = instantiate(OmegaConf.load("configs/worldmodel/tiny.yaml"), _convert_="all").eval()
    wm.set_norm_stats(torch.randn(10, 9), torch.randn(10, 9))
    cr = instantiate(OmegaConf.load("configs/critic/tiny.yaml"), _convert_="all").eval()
    cr.set_norm_stats(torch.randn(10, 9))
    ep = make_episodes(1, length=10, size=32, seed=2)[0]
    ctx = Obs({c: torch.from_numpy(v[3:4]) for c, v in ep.images.items()}, torch.from_numpy(ep.proprio[3:4]),
              [ep.instruction])
    starts = [Start(task_name="toy", instruction=ep.instruction, context=ctx, episode=0, step=3)] * 4
    env = ImaginationEnv(wm, cr, num_envs=4, max_chunks=3, success_threshold=2.0, seed=0)

    class RandomPolicy:
        chunk_size, action_dim = 4, 7

        def sample(self, obs, generator=None):
            a = torch.rand(obs.batch_size, 4, 7, generator=generator) * 2 - 1
            return PolicySample(a, torch.zeros(obs.batch_size))

    ro = rollout_batch(env, RandomPolicy(), starts, torch.arange(4), max_chunks=5,
                       generator=torch.Generator().manual_seed(0))
    assert ro.rewards.shape == (4, 3) and torch.isfinite(ro.rewards).all()
    assert ro.alive[:, -1].all() and not ro.success.any()     # truncated after max_chunks=3
    # rewards are progress gains: they telescope to progress(last) - progress(first)
    first = cr.progress(ctx)
    assert torch.all(ro.rewards.sum(1) >= -first - 1e-5) and torch.all(ro.rewards.sum(1) <= 1 - first + 1e-5)


class ArmWorldModel(CounterWorldModel):
    """CounterWorldModel whose proprio is a scripted arm: each chunk sets z (dim 2) and the finger gap
    (dims 7, 8) from the action's dims 1 and 2, and whose uncertainty is the action's dim 3."""

    def init(self, context: Obs):
        return (context, None)

    def imagine(self, state, actions, generator=None):
        obs, _ = state
        new, _ = super().imagine(obs, actions)
        p = new.proprio.clone()
        p[:, 2] = actions[:, -1, 1]
        p[:, 7], p[:, 8] = actions[:, -1, 2] / 2, -actions[:, -1, 2] / 2
        new = Obs(new.images, p, new.task)
        return (new, actions[:, -1, 3].clone()), new

    def uncertainty(self, state):
        return state[1]


def arm_chunk(level, z, gap, grip, unc=0.0):
    a = torch.zeros(len(level), 4, 7)
    a[:, :, 0] = torch.tensor(level, dtype=torch.float32)[:, None] / 4
    a[:, :, 1] = torch.tensor(z, dtype=torch.float32)[:, None]
    a[:, :, 2] = torch.tensor(gap, dtype=torch.float32)[:, None]
    a[:, :, 3] = torch.tensor(unc, dtype=torch.float32)[:, None] if not np.isscalar(unc) else unc
    a[:, :, 6] = torch.tensor(grip, dtype=torch.float32)[:, None]
    return a


def test_proprio_lift_rule_gates_the_critics_success_on_lifts_only():
    """The critic says success from the second chunk on (level >= 100) for both slots; slot 0 is a
    lift, so it also needs a held object raised: closed >= 8 steps, gap >= 2.5 cm, 4 cm above the
    lowest z since closing."""
    from wmrl.imagination import ProprioLiftRule

    env = ImaginationEnv(ArmWorldModel(), LevelCritic(), num_envs=2, max_chunks=8, auto_reset=False,
                         proprio_success=ProprioLiftRule(["lift"], closed_steps=8, gap_min_m=0.025, rise_min_m=0.04))
    env.reset([level_start(0, "lift"), level_start(0, "stack")])
    r = env.step(arm_chunk([50, 50], z=[0.0, 0.0], gap=[0.05, 0.05], grip=[-1, -1]))   # open, at the bottom
    assert not r.success.any()
    r = env.step(arm_chunk([50, 50], z=[0.0, 0.0], gap=[0.04, 0.04], grip=[1, 1]))    # closes: 4 steps
    assert r.success.tolist() == [False, True]        # the critic alone decides the stack
    r = env.step(arm_chunk([0, 0], z=[0.05, 0.05], gap=[0.01, 0.01], grip=[1, 1]))    # raised, but on nothing
    assert not r.success[0]
    env.reset([level_start(100, "lift"), level_start(0, "stack")])
    env.step(arm_chunk([0, 0], z=[0.0, 0.0], gap=[0.04, 0.04], grip=[1, 1]))
    r = env.step(arm_chunk([0, 0], z=[0.02, 0.0], gap=[0.04, 0.04], grip=[1, 1]))     # 8 steps closed, 2 cm up
    assert not r.success[0]
    r = env.step(arm_chunk([0, 0], z=[0.05, 0.0], gap=[0.04, 0.04], grip=[1, 1]))     # 5 cm above the low point
    assert r.success[0] and r.terminated[0]


def test_an_uncertain_imagined_state_halts_the_slot_with_no_reward():
    env = ImaginationEnv(ArmWorldModel(), LevelCritic(), num_envs=3, max_chunks=5, auto_reset=False,
                         halt_uncertainty=0.02)
    env.reset([level_start(0), level_start(0), level_start(90)])
    r = env.step(arm_chunk([20, 20, 20], z=[0, 0, 0], gap=[0, 0, 0], grip=[-1, -1, -1], unc=[0.0, 0.05, 0.05]))
    assert r.info["halted"].tolist() == [False, True, False]   # slot 2 succeeded (level 110): not halted
    assert r.terminated.tolist() == [False, True, True] and r.reward[1] == 0 and not r.success[1]
    assert r.success[2] and env.halted == 1
    assert r.info["uncertainty"].tolist() == pytest.approx([0.0, 0.05, 0.05])   # the disagreement itself
    quiet = ImaginationEnv(ArmWorldModel(), LevelCritic(), num_envs=1, max_chunks=5)   # no halt: still reported
    quiet.reset([level_start(0)])
    r = quiet.step(arm_chunk([20], z=[0], gap=[0], grip=[-1], unc=[0.03]))
    assert r.info["uncertainty"].tolist() == pytest.approx([0.03]) and not r.info["halted"].any()
    counter = ImaginationEnv(CounterWorldModel(), LevelCritic(), num_envs=1, max_chunks=5)
    counter.reset([level_start(0)])
    assert "uncertainty" not in counter.step(torch.zeros(1, 4, 7)).info      # no such capability: no key
    from wmrl.kernel.interfaces import CountingEnv

    assert isinstance(env, CountingEnv) and env.counters() == {"halted": 1, "grasp_misses": 0}   # what GRPO reports
    with pytest.raises(ValueError, match="UncertainWorldModel"):
        ImaginationEnv(CounterWorldModel(), LevelCritic(), num_envs=1, halt_uncertainty=0.02)


class MemoryWorldModel(CounterWorldModel):
    """CounterWorldModel whose state also counts the chunks imagined since ``init`` (shown in proprio
    dim 0): a hidden state that only the ``SlotStateWorldModel`` capability can keep across resets."""

    def init(self, context: Obs):
        return (context, torch.zeros(context.batch_size))

    def imagine(self, state, actions, generator=None):
        obs, count = state
        new, _ = super().imagine(obs, actions)
        count = count + 1
        p = new.proprio.clone()
        p[:, 0] = count
        new = Obs(new.images, p, new.task)
        return (new, count), new


class SlotMemoryWorldModel(MemoryWorldModel):
    def merge_states(self, state, slots, other):
        obs = Obs({k: torch.where(slots[:, None, None, None], other[0].images[k], v) for k, v in state[0].images.items()},
                  torch.where(slots[:, None], other[0].proprio, state[0].proprio), list(state[0].task))
        return obs, torch.where(slots, other[1], state[1])


@pytest.mark.parametrize("model,kept", [(SlotMemoryWorldModel, True), (MemoryWorldModel, False)])
def test_resetting_one_slot_keeps_the_others_state_only_with_the_capability(model, kept):
    """Slot 0 succeeds after one chunk and is reset; slot 1 runs on. A world model that can merge
    states per slot keeps slot 1's hidden chunk count (2 after the second chunk); one that cannot is
    re-initialised from the observations (its count restarts). A finished slot without auto-reset
    keeps its state too."""
    from wmrl.kernel.interfaces import SlotStateWorldModel

    assert isinstance(model(), SlotStateWorldModel) == kept
    env = ImaginationEnv(model(), LevelCritic(), num_envs=2, max_chunks=5)
    env.reset([level_start(90), level_start(0)])
    r = env.step(chunk([20, 20]))
    assert r.terminated.tolist() == [True, False]
    r = env.step(chunk([1, 1]))
    assert r.obs.proprio[1, 0] == (2 if kept else 1) and r.obs.proprio[0, 0] == 1
    env = ImaginationEnv(model(), LevelCritic(), num_envs=2, max_chunks=5, auto_reset=False)
    env.reset([level_start(90), level_start(0)])
    env.step(chunk([20, 20]))
    env.step(chunk([1, 1]))                 # slot 0 frozen from here on
    r = env.step(chunk([1, 1]))
    assert r.obs.proprio[1, 0] == (3 if kept else 1)


def test_wm_state_merge_takes_the_slots_from_the_other_state():
    from worldmodels.state import WMState

    a = WMState(torch.zeros(3, 3, 2, 2), torch.zeros(3, 9), ["a"] * 3, prev_proprio=torch.ones(3, 9),
                uncertainty=torch.full((3,), 0.5))
    b = WMState(torch.ones(3, 3, 2, 2), torch.full((3, 9), 2.0), ["b"] * 3)        # just init-ed
    m = a.merge(torch.tensor([False, True, False]), b)
    assert m.task == ["a", "b", "a"] and m.frames[1].eq(1).all() and m.frames[0].eq(0).all()
    assert m.prev_proprio[1].eq(2).all() and m.prev_proprio[0].eq(1).all()          # b at rest
    assert m.uncertainty.tolist() == [0.5, 0.0, 0.5] and a.frames.eq(0).all()


def test_a_calibrated_halt_threshold_comes_from_the_world_models_report():
    from wmrl.run.pipeline import _calibrated_env

    env = {"num_envs": 4, "imagination": {"halt_uncertainty": "calibrated", "max_chunks": 3}}
    out = _calibrated_env(env, {"heldout_horizons": {"halt_uncertainty_tau_m": 0.004}})
    assert out["imagination"] == {"halt_uncertainty": 0.004, "max_chunks": 3} and out["num_envs"] == 4
    assert _calibrated_env({"imagination": {"halt_uncertainty": 0.01}}, {}) == {"imagination": {"halt_uncertainty": 0.01}}
    with pytest.raises(ValueError, match="dynamics ensemble"):
        _calibrated_env(env, {"heldout_horizons": {}})
    with pytest.raises(ValueError, match="give a number"):
        ImaginationEnv(ArmWorldModel(), LevelCritic(), num_envs=1, halt_uncertainty="calibrated")


def test_release_rule_needs_a_held_object_let_go():
    """Stacking (a release task): the critic says success from the second chunk on; the rule also
    needs an object held at an earlier chunk end (closed >= 8 steps, gap >= 2.5 cm) and the gripper
    commanded open on the chunk's last step. Opening without having held anything is no success."""
    from wmrl.imagination import ProprioLiftRule

    rule = ProprioLiftRule(["lift"], closed_steps=8, gap_min_m=0.025, rise_min_m=0.04, release_tasks=["stack"])
    env = ImaginationEnv(ArmWorldModel(), LevelCritic(), num_envs=2, max_chunks=8, auto_reset=False, proprio_success=rule)
    env.reset([level_start(100, "stack"), level_start(100, "stack")])
    r = env.step(arm_chunk([0, 0], z=[0.0, 0.0], gap=[0.04, 0.01], grip=[1, 1]))     # slot 1 closes on nothing
    assert not r.success.any()
    r = env.step(arm_chunk([0, 0], z=[0.05, 0.05], gap=[0.04, 0.01], grip=[1, 1]))   # 8 steps closed: slot 0 holds
    assert not r.success.any()                                                      # held, not yet let go
    r = env.step(arm_chunk([0, 0], z=[0.05, 0.05], gap=[0.08, 0.08], grip=[-1, -1]))  # both open
    assert r.success.tolist() == [True, False]
    env.reset([level_start(100, "stack"), level_start(0, "stack")])
    r = env.step(arm_chunk([0, 0], z=[0.0, 0.0], gap=[0.08, 0.08], grip=[-1, -1]))   # the held flag was reset
    assert not r.success.any()
    with pytest.raises(ValueError, match="both lifts and release"):
        ProprioLiftRule(["stack"], release_tasks=["stack"])


def test_release_rule_can_wait_for_fingers_commanded_open_long_enough():
    """With ``release_open_steps=4`` (the chunk here is 4 steps) a chunk that turns open on its last
    step is not yet a release, the next (open throughout) is; slot 1 opens on its first step and is
    released at once. The default (1) counts the first chunk."""
    from wmrl.imagination import ProprioLiftRule

    def run(open_steps):
        rule = ProprioLiftRule(["lift"], closed_steps=8, gap_min_m=0.025, rise_min_m=0.04, release_tasks=["stack"],
                               release_open_steps=open_steps)
        env = ImaginationEnv(ArmWorldModel(), LevelCritic(), num_envs=2, max_chunks=8, auto_reset=False,
                             proprio_success=rule)
        env.reset([level_start(100, "stack"), level_start(100, "stack")])
        for _ in range(2):                                                           # 8 steps closed: both hold
            env.step(arm_chunk([0, 0], z=[0.05, 0.05], gap=[0.04, 0.04], grip=[1, 1]))
        a = arm_chunk([0, 0], z=[0.05, 0.05], gap=[0.06, 0.08], grip=[1, -1])
        a[0, -1, 6] = -1.0                                                           # slot 0: open on the last step only
        first = env.step(a).success.tolist()
        second = env.step(arm_chunk([0, 0], z=[0.05, 0.05], gap=[0.08, 0.08], grip=[-1, -1])).success.tolist()
        return first, second

    assert run(4) == ([False, True], [True, False])      # slot 1 already finished
    assert run(1)[0] == [True, True]
    with pytest.raises(ValueError, match="release_open_steps"):
        ProprioLiftRule(["lift"], release_open_steps=0)


def test_grasp_box_turns_a_close_away_from_the_object_into_a_miss():
    """Three lift slots close at the same imagined end effector (x = y = 1 m after one chunk of
    ArmWorldModel) with a finger gap that reads as a hold, then raise the arm. Slot 0's object is at
    the end effector, slot 1's 10 cm off in x (a miss: no success, counted once), slot 2's unknown
    (NaN: never a miss). The critic never says success; with ``lifts_need_critic=False`` the rule
    alone decides the lifts."""
    from wmrl.imagination import ProprioLiftRule

    where = {"a": (1.0, 1.0, 0.0), "b": (1.1, 1.0, 0.0), "c": None}
    rule = ProprioLiftRule(["lift"], closed_steps=8, gap_min_m=0.025, rise_min_m=0.04,
                           grasp_box_m=(0.035, 0.03, 0.02), lifts_need_critic=False)
    env = ImaginationEnv(ArmWorldModel(), LevelCritic(), num_envs=3, max_chunks=8, auto_reset=False,
                         proprio_success=rule, start_objects=lambda s: where[s.instruction[-1]])
    starts = [level_start(0, "lift") for _ in range(3)]
    for s, k in zip(starts, "abc"):
        s.instruction = f"lift {k}"
    env.reset(starts)
    r = env.step(arm_chunk([0] * 3, z=[0.0] * 3, gap=[0.04] * 3, grip=[1] * 3))   # the close, at x = y = 1
    assert not r.success.any() and env.grasp_misses == 1
    r = env.step(arm_chunk([0] * 3, z=[0.05] * 3, gap=[0.04] * 3, grip=[1] * 3))  # held 8 steps and raised 5 cm
    assert r.success.tolist() == [True, False, True]
    assert env.grasp_misses == 1          # the miss is counted once, not per chunk it lasts
    env.reset(starts)                     # a reset clears the miss; the next close is judged afresh
    env.step(arm_chunk([0] * 3, z=[0.0] * 3, gap=[0.08] * 3, grip=[-1] * 3))
    env.step(arm_chunk([0] * 3, z=[0.0] * 3, gap=[0.08] * 3, grip=[-1] * 3))
    r = env.step(arm_chunk([0] * 3, z=[0.0] * 3, gap=[0.04] * 3, grip=[1] * 3))   # from x = y = 2 to 3: every known object off
    assert env.grasp_misses == 3
    with pytest.raises(ValueError, match="3 positive lengths"):
        ProprioLiftRule(["lift"], grasp_box_m=(0.03, 0.03))


def test_box_miss_reads_the_offset_in_the_base_frame():
    from wmrl.imagination import ProprioLiftRule

    rule = ProprioLiftRule(["lift"], grasp_box_m=(0.03, 0.02, 0.01))
    obj = np.array([[0.5, 0.0, 0.02]] * 5)
    ee = obj + np.array([[0.029, -0.019, -0.05],      # inside (below the centre is fine: fingers reach down)
                         [0.031, 0.0, 0.0],           # off in x
                         [0.0, -0.021, 0.0],          # off in y
                         [0.0, 0.0, 0.011],           # closing above the object
                         [0.0, 0.0, 0.0]])
    obj[4] = np.nan
    assert rule.box_miss(ee, obj).tolist() == [False, True, True, True, False]
    assert not ProprioLiftRule(["lift"]).box_miss(ee, obj).any()


def test_reopening_the_gripper_clears_a_miss():
    from wmrl.imagination import ProprioLiftRule

    rule = ProprioLiftRule(["lift"], closed_steps=4, grasp_box_m=(0.03, 0.03, 0.02))
    closed, z_low, held, missed = np.zeros(1, int), np.zeros(1), np.zeros(1, bool), np.zeros(1, bool)
    obj = np.array([[0.5, 0.0, 0.0]])

    def step(x, grip):
        p = torch.zeros(1, 9)
        p[0, 0], p[0, 7], p[0, 8] = x, 0.02, -0.02
        a = torch.full((1, 4, 5), float(grip))
        return rule.update(closed, z_low, p, p, a, held, ["lift"], missed=missed, objects=obj)

    step(0.6, 1)                          # closes 10 cm off: a miss
    assert missed[0]
    step(0.5, 1)                          # still closed, now above the object: still the same miss
    assert missed[0]
    step(0.5, -1)                         # opened
    assert not missed[0]
    step(0.5, 1)                          # closes on the object
    assert not missed[0]


def test_a_start_with_the_object_in_the_hand_is_not_a_miss_when_the_arm_carries_it_away():
    """A keyframe start mid-lift: the gripper is commanded closed from the chunk's first step with the
    end effector on the object, and the chunk raises it 5 cm (its end is off the box in z). The close
    began on the object: no miss, and the hold counts. A chunk closed from its first step that is off
    the object at both ends is still a miss."""
    from wmrl.imagination import ProprioLiftRule

    rule = ProprioLiftRule(["lift"], closed_steps=4, grasp_box_m=(0.03, 0.03, 0.02))
    obj = np.array([[0.5, 0.0, 0.0], [0.6, 0.0, 0.0]])
    closed, z_low, held, missed = np.zeros(2, int), np.zeros(2), np.zeros(2, bool), np.zeros(2, bool)
    p0, p1 = torch.zeros(2, 9), torch.zeros(2, 9)
    p0[:, 0] = p1[:, 0] = 0.5
    p1[:, 2] = 0.05
    p0[:, 7] = p1[:, 7] = 0.02
    p0[:, 8] = p1[:, 8] = -0.02
    a = torch.ones(2, 8, 5)
    rule.update(closed, z_low, p0, p1, a, held, ["lift", "lift"], missed=missed, objects=obj)
    assert missed.tolist() == [False, True] and held.tolist() == [True, False]


def test_a_slot_truncates_at_its_tasks_step_limit():
    """The sim truncates an episode at its task's control-step limit; imagination ends the slot after
    the last chunk that fits whole within it (10 steps, chunks of 4: after 2 chunks), never later
    than ``max_chunks``."""
    limits = {"short": 10, "long": 1000}
    env = ImaginationEnv(CounterWorldModel(), LevelCritic(), num_envs=2, max_chunks=4, auto_reset=False,
                         max_steps=lambda t: limits[t])
    env.reset([level_start(0, "short"), level_start(0, "long")])
    r1 = env.step(chunk([0, 0]))
    r2 = env.step(chunk([0, 0]))
    assert r1.truncated.tolist() == [False, False] and r2.truncated.tolist() == [True, False]
    env.step(chunk([0, 0]))
    r4 = env.step(chunk([0, 0]))
    assert r4.truncated.tolist() == [False, True]          # max_chunks
    assert r4.steps_executed.tolist() == [0, 4]


def _place_env(goals, **rule_kw):
    """Three stacking slots of ArmWorldModel (the end effector is at x = y = k after chunk k): the red
    cube at (1, 1, 0), picked up in chunk 1, carried in chunk 2 (8 steps closed: held), let go in
    chunk 3 (starting at x = y = 2, the end of chunk 2)."""
    from wmrl.imagination import ProprioLiftRule

    rule = ProprioLiftRule(["lift"], closed_steps=8, gap_min_m=0.025, rise_min_m=0.04, release_tasks=["stack"],
                           grasp_box_m=(0.035, 0.03, 0.02), place_box_m=(0.02, 0.02, 0.08),
                           releases_need_critic=False, **rule_kw)
    starts = [level_start(0, "stack") for _ in goals]
    for j, s in enumerate(starts):
        s.instruction = str(j)
    env = ImaginationEnv(ArmWorldModel(), LevelCritic(), num_envs=len(goals), max_chunks=8, auto_reset=False,
                         proprio_success=rule, start_objects=lambda s: (1.0, 1.0, 0.0),
                         start_goals=lambda s: goals[int(s.instruction)])
    return env, starts


def test_place_box_scores_a_release_over_the_goal_without_the_critic():
    """The critic never says success (level 0); with ``releases_need_critic=False`` the rule decides.
    Slot 0's goal sits 4.5 cm below where the cube is let go (a stack: success); slot 1's 3 cm off
    in x (a miss); slot 2's is unknown (never a miss). Slot 1 cannot score later either: its release
    was judged and the object let go, so the open hand drifting on (over its goal or not) is nothing."""
    goals = [(2.0, 2.0, -0.045), (2.03, 2.0, -0.045), None]
    env, starts = _place_env(goals)
    env.reset(starts)
    n = len(goals)
    assert not env.step(arm_chunk([0] * n, z=[0.0] * n, gap=[0.04] * n, grip=[1] * n)).success.any()  # close at (1, 1)
    assert not env.step(arm_chunk([0] * n, z=[0.0] * n, gap=[0.04] * n, grip=[1] * n)).success.any()  # carried to (2, 2)
    r = env.step(arm_chunk([0] * n, z=[0.0] * n, gap=[0.08] * n, grip=[-1] * n))                       # let go
    assert r.success.tolist() == [True, False, True]
    r = env.step(arm_chunk([0] * n, z=[0.0] * n, gap=[0.08] * n, grip=[-1] * n))
    assert not r.success.any()


def test_place_box_reads_the_hand_where_the_release_begins():
    """The release is judged where the hand is when the open chunk starts, in the base frame: within
    ``r`` horizontally of the goal and ``z_min..z_max`` above it; a release over nothing clears the
    hold (judged once), so the next open chunk, even over the goal, is no stack."""
    from wmrl.imagination import ProprioLiftRule

    rule = ProprioLiftRule(["lift"], closed_steps=4, gap_min_m=0.025, release_tasks=["stack"],
                           place_box_m=(0.02, 0.02, 0.08), releases_need_critic=False)
    hand = np.array([2.0, 2.0, 0.0])
    goals = hand - np.array([[0.0, 0.019, 0.045],    # inside
                             [0.015, 0.015, 0.045],  # 2.1 cm off horizontally
                             [0.0, 0.0, 0.015],      # too low (the cube would be in the goal)
                             [0.0, 0.0, 0.085],      # too high (a drop)
                             [np.nan] * 3])          # unknown: never a miss
    assert rule.place_miss(np.tile(hand, (5, 1)), goals).tolist() == [False, True, True, True, False]
    n = len(goals)
    closed, z_low, held = np.zeros(n, int), np.zeros(n), np.zeros(n, bool)

    def step(grip, gap):
        p = torch.zeros(n, 9)
        p[:, :3] = torch.as_tensor(hand)
        p[:, 7], p[:, 8] = gap / 2, -gap / 2
        return rule.update(closed, z_low, p, p, torch.full((n, 4, 5), float(grip)), held, ["stack"] * n, goals=goals)

    step(1, 0.04)
    step(1, 0.04)                              # 8 steps closed on a 4 cm object: held
    assert held.all()
    assert step(-1, 0.08).tolist() == [True, False, False, False, True]
    assert not held.any()                      # let go: judged once
    assert not step(-1, 0.08).any()


def test_a_start_with_the_fingers_on_an_object_already_holds():
    """``start_holding_max_gap_m``: two keyframe starts in a carry, the end effector at (0, 0, 0).
    Slot 0's real fingers are 4 cm apart (on the cube): its closed streak starts at ``closed_steps``,
    so one closed chunk (4 steps) carrying it to (1, 1) is a hold and letting go there, over the
    goal, a stack. Slot 1's fingers are 8 cm apart (open): 4 closed steps are not a hold, and the
    same release scores nothing."""
    from wmrl.imagination import ProprioLiftRule

    env, starts = _place_env([(1.0, 1.0, -0.045)] * 2, start_holding_max_gap_m=0.06)
    env.start_objects = lambda s: (0.0, 0.0, 0.0)      # the cube in the hand (the grasp box passes the carry)
    for s, gap in zip(starts, (0.04, 0.08)):
        s.context.proprio[:, 7], s.context.proprio[:, 8] = gap / 2, -gap / 2
    rule = env.proprio_success
    assert rule.starts_holding(torch.cat([s.context.proprio for s in starts])).tolist() == [True, False]
    env.reset(starts)
    assert not env.step(arm_chunk([0, 0], z=[0.0, 0.0], gap=[0.04, 0.04], grip=[1, 1])).success.any()
    r = env.step(arm_chunk([0, 0], z=[0.0, 0.0], gap=[0.08, 0.08], grip=[-1, -1]))
    assert r.success.tolist() == [True, False]
    assert not ProprioLiftRule(["lift"]).starts_holding(starts[0].context.proprio).any()   # off by default


def test_place_box_options_are_checked():
    from wmrl.imagination import ProprioLiftRule

    for box in ((0.015, 0.02), (0.0, 0.02, 0.08), (0.015, 0.08, 0.02)):
        with pytest.raises(ValueError, match="place_box_m"):
            ProprioLiftRule(["lift"], place_box_m=box)
    with pytest.raises(ValueError, match="needs a place_box_m"):
        ProprioLiftRule(["lift"], releases_need_critic=False)
    with pytest.raises(ValueError, match="start_holding_max_gap_m"):
        ProprioLiftRule(["lift"], gap_min_m=0.02, start_holding_max_gap_m=0.02)


def test_keyframe_success_fraction_balances_successful_and_failed_episodes(tmp_path):
    """success_fraction=0.5: about half the keyframes come from successful episodes although the failed
    one holds most of the steps; None keeps the draw uniform over steps (the same stream as before)."""
    import dataclasses

    from wmrl.kernel.storage import EpisodeStore
    from wmrl.rl.starts import KeyframeStarts
    from worldmodels.synthetic import make_episode

    store = EpisodeStore.create(tmp_path / "s", cameras={"agentview": (32, 32), "robot0_eye_in_hand": (32, 32)},
                                state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE, embodiment="toy",
                                source="synthetic")
    won = dataclasses.replace(make_episode(1, 16, 32, expert=True), success=True)    # 8 drawable steps
    lost = dataclasses.replace(make_episode(2, 88, 32, expert=False), success=False)  # 80 drawable steps
    for e in (won, lost):
        store.append(e)
    assert store.successes.tolist() == [True, False]
    uniform = starts_from_store(store, 400, np.random.default_rng(0))
    balanced = starts_from_store(store, 400, np.random.default_rng(0), success_fraction=0.5)
    share = lambda starts: np.mean([s.episode == 0 for s in starts])   # noqa: E731
    assert share(uniform) < 0.2                 # 8 of 88 steps: ~0.09
    assert 0.4 < share(balanced) < 0.6
    assert all(s.step < 8 for s in balanced if s.episode == 0) and all(s.step < 80 for s in balanced)
    assert share(starts_from_store(store, 50, np.random.default_rng(0), success_fraction=1.0)) == 1.0
    assert share(starts_from_store(store, 50, np.random.default_rng(0), success_fraction=0.0)) == 0.0
    only_lost = starts_from_store(store, 20, np.random.default_rng(0), episodes=[1], success_fraction=0.9)
    assert {s.episode for s in only_lost} == {1}   # no successful episode: the failed ones
    ks = KeyframeStarts(tmp_path / "s", {won.task_name: won.instruction}, per_task=40, seed=3, success_fraction=0.5)
    assert [(s.episode, s.step) for s in ks(2)] == [(s.episode, s.step) for s in ks(2)]
    with pytest.raises(ValueError, match="success_fraction"):
        starts_from_store(store, 1, np.random.default_rng(0), success_fraction=1.5)
