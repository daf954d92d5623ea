"""World model in the loop: refresh the world model and the critic on real rollouts of the policy
being trained, during GRPO in imagination.

A policy optimised in a world model drifts to states the model has not seen and learns actions the
model rewards and the real arm does not (the imagined success climbs while the real one falls).
World-VLA-Loop and WoVR close the loop: every few GRPO iterations the *current* policy is rolled out
in the real sim, its episodes (successes and, mostly, failures) join the world model's data, and
the world model and the critic are fine-tuned on them, so the model learns what those actions
really do before the policy is optimised against it again. The optimisation itself stays in
imagination; the real rollouts are data for the world model (a few dozen per refresh, against the
thousands of imagined rollouts).

:class:`WorldModelRefresher` is the callback of ``wmrl.rl.loop.RefreshHook`` that ``train_grpo`` calls every
``every`` iterations. ``wmrl.rl.rollout.record_episodes`` runs a policy in a ``SimEnv`` and keeps every
control step (the pipeline's BC rollouts use it too).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from wmrl.imagination import ImaginationEnv
from wmrl.kernel.types import Episode, Start
from wmrl.rl.rollout import record_episodes
from wmrl.rl.starts import InitStateStarts

log = logging.getLogger("wmrl.refresh")


def store_like(template, dest, source: str):
    """A new empty ``EpisodeStore`` at ``dest`` (replaced if it exists) with the cameras, dimensions,
    fps, action space and embodiment of the open store ``template``."""
    from wmrl.kernel.storage import EpisodeStore

    m = template.meta
    return EpisodeStore.create(dest, cameras={k: tuple(v) for k, v in m["cameras"].items()}, state_dim=m["state_dim"],
                               action_dim=m["action_dim"], fps=m["fps"], action_space=template.action_space,
                               embodiment=m.get("embodiment", "panda"), source=source, overwrite=True)


@dataclass
class RefreshConfig:
    """The settings of :class:`WorldModelRefresher` (``configs/post_train.yaml`` ``refresh``): train
    init states per task (``n_init``), rollouts per task and their step cap, replayed store episodes,
    the held-out split, the fine-tunes' seconds (wall-clock caps), LRs and batch sizes, the
    deterministic-path fraction of the world model, the critic's imagined fraction and frame bank."""

    n_init: int = 50
    episodes_per_task: int = 8
    max_steps: int = 160
    replay_episodes: int = 48
    heldout_every: int = 5
    wm_seconds: float = 45.0
    wm_lr: float = 3e-4
    wm_batch_size: int = 32
    wm_p_deterministic: float = 0.5
    critic_seconds: float = 20.0
    critic_lr: float = 3e-4
    critic_batch_size: int = 64
    imagined_fraction: float = 0.5
    bank_size: int = 256
    bank_chunks: int = 2
    seed: int = 0
    progress: bool = True

    def __post_init__(self):   # values from YAML / the command line as the field's type (int, float, bool)
        casts = {"int": int, "float": float, "bool": bool}
        for f in dataclasses.fields(self):
            setattr(self, f.name, casts[f.type](getattr(self, f.name)))


class WorldModelRefresher:
    """Fine-tunes an ``ImaginationEnv``'s world model and critic on real rollouts of the current policy.

    Each call (``refresher(policy, iteration)``):

    1. runs ``policy`` (with whatever sampler it has, during GRPO the stochastic RL sampler) in the
       real sim from ``episodes_per_task`` train init states per task (drawn afresh every round
       from ``iteration`` and ``seed``), recording every step (:func:`record_episodes`);
    2. fine-tunes the world model (``finetunes.world_model``, no re-fit of its
       normalisation statistics) for ``wm_seconds`` on every on-policy episode recorded so far plus
       ``replay_episodes`` episodes of the training split of ``store`` (its original data, against
       forgetting);
    3. fine-tunes the critic on the same episodes for ``critic_seconds``, with a fraction
       ``imagined_fraction`` of each batch from the refreshed world model's version of them
       (``finetunes.bank``), so that the critic learns how the policy's
       failures look in imagination;
    4. saves both under ``out_dir/round_<iteration>/`` and records the round in ``out_dir/latest.json``
       (:meth:`restore` loads it when a killed GRPO run resumes).

    The modules are updated in place, so the ``ImaginationEnv`` (and any replay envs given in
    ``also_update``) imagine with the new weights from the next iteration on.

    Args:
        env: the ``ImaginationEnv`` (its ``world_model`` / ``critic`` are fine-tuned).
        sim_env: a ``SimEnv`` (``num_envs`` slots) for the real rollouts.
        tasks: ``{task name: instruction}``.
        store: the world model's training ``EpisodeStore`` folder (replay data; its metadata is used
            for the stores of recorded rollouts).
        world_model_config, critic_config: constructor configs of the two modules (their checkpoints'
            ``config.yaml``, ``wmrl.kernel.checkpoint.read_checkpoint_config``), saved with each round.
        config: :class:`RefreshConfig` (``n_init``: train init states per task to draw from, ...).
        finetunes: what the world-model package provides for the fine-tunes, injected by the composition
            root (``worldmodels.train.RefreshFineTunes``): ``heldout_split(n, every)``,
            ``frames(episodes, cameras)``, ``world_model(...)`` / ``critic(...)`` (the trainers of
            ``wmrl.kernel.trainer``, time-capped) and ``bank(...)`` (imagined frames).

    Raises:
        ValueError: ``episodes_per_task < 1``, the env has no ``world_model`` / ``critic``, no ``finetunes``, or the
            store lacks the world model's cameras.

    Reference: World-VLA-Loop (failures refine the world model), WoVR (world model refined on the
    policy's rollouts, LIBERO 39.9 -> 69.2 %).
    """

    def __init__(self, env, sim_env, tasks: dict, out_dir, store, world_model_config: dict, critic_config: dict,
                 finetunes, config: RefreshConfig | None = None, also_update: Sequence = ()):
        c = config if config is not None else RefreshConfig()
        if int(c.episodes_per_task) < 1:
            raise ValueError(f"refresh.episodes_per_task must be >= 1, got {c.episodes_per_task}")
        if not isinstance(env, ImaginationEnv):
            raise ValueError(f"world-model refresh needs an ImaginationEnv (got {type(env).__name__}); use env=imagination")
        if finetunes is None:
            raise ValueError("WorldModelRefresher needs finetunes= (e.g. worldmodels.train.RefreshFineTunes()): the "
                             "engine does not import the world-model package, the composition root passes it")
        self.finetunes, self.config = finetunes, c
        self.env, self.sim_env, self.tasks = env, sim_env, dict(tasks)
        self.out_dir = Path(out_dir)
        self.also_update = list(also_update)
        self.cameras = list(env.world_model.cameras)
        self.wm_config = {k: v for k, v in dict(world_model_config).items() if k != "_target_"}
        self.critic_config = {k: v for k, v in dict(critic_config).items() if k != "_target_"}
        from wmrl.kernel.storage import EpisodeStore

        st = EpisodeStore.open(store, mode="r")
        missing = [c for c in self.cameras if c not in st.cameras]
        if missing:
            raise ValueError(f"refresh.store {store} lacks the world model's cameras {missing} (has {list(st.cameras)})")
        self.template = st
        self.replay: list[Episode] = []
        if int(c.replay_episodes) > 0:
            tr, _ = finetunes.heldout_split(len(st), int(c.heldout_every))
            rng = np.random.default_rng([self.config.seed, 23])
            pick = sorted(rng.choice(tr, size=min(len(tr), int(c.replay_episodes)), replace=False).tolist())
            self.replay = [st.episode(i, self.cameras) for i in pick]
        self.onpolicy: list[Episode] = []
        self.restored: int | None = None

    # ---------------------------------------------------------------- rollouts
    def starts(self, iteration: int) -> list[Start]:
        k = min(self.config.episodes_per_task, self.config.n_init)
        return InitStateStarts(self.tasks, self.config.n_init, k, split="train", seed=self.config.seed, stream=(29,))(iteration)

    def _store_round(self, episodes: list[Episode], folder: Path) -> None:
        st = store_like(self.template, folder, "grpo_refresh")
        for e in episodes:
            st.append(e)

    # ---------------------------------------------------------------- the round
    def __call__(self, policy, iteration: int) -> dict:
        ft = self.finetunes
        t0 = time.time()
        rdir = self.out_dir / f"round_{int(iteration):04d}"
        was_training = isinstance(policy, torch.nn.Module) and policy.training
        if isinstance(policy, torch.nn.Module):
            policy.eval()
        eps = record_episodes(self.sim_env, policy, self.starts(iteration), self.config.max_steps,
                              generator=torch.Generator().manual_seed(self.config.seed + 31 * int(iteration)),
                              source="grpo_refresh", progress=self.config.progress, desc="refresh rollouts")
        if was_training:
            policy.train()
        t_roll = time.time() - t0
        self._store_round(eps, rdir / "rollouts.zarr")
        self.onpolicy.extend(eps)
        mixed = ft.frames(self.onpolicy + self.replay, self.cameras)
        succ = {t: float(np.mean([e.success for e in eps if e.task_name == t])) for t in self.tasks}

        wm, critic = self.env.world_model, self.env.critic
        log.info("refresh at iteration %d: %d real rollouts (success %s); fine-tuning the world model %.0f s and the "
                 "critic %.0f s on %d on-policy + %d replay episodes", iteration, len(eps), succ, self.config.wm_seconds,
                 self.config.critic_seconds, len(self.onpolicy), len(self.replay))
        t1 = time.time()
        wm_rep = ft.world_model(wm, self.wm_config, mixed, rdir / "worldmodel", steps=10 ** 6,
                               batch_size=self.config.wm_batch_size, lr=self.config.wm_lr, warmup=5,
                               max_minutes=self.config.wm_seconds / 60, checkpoint_every=10 ** 6, eval_every=10 ** 6,
                               resume=False, tensorboard=False, progress=False, seed=self.config.seed + int(iteration),
                               p_deterministic=self.config.wm_p_deterministic, fit_stats=False)
        wm.eval()
        t2 = time.time()
        bank = None
        if self.config.imagined_fraction > 0 and self.config.bank_size > 0:
            bank = ft.bank(wm, mixed, self.config.bank_size, self.config.bank_chunks,
                          np.random.default_rng([self.config.seed, 37, int(iteration)]), progress=False)
        c_rep = ft.critic(critic, self.critic_config, mixed, rdir / "critic", steps=10 ** 6,
                          batch_size=self.config.critic_batch_size, lr=self.config.critic_lr, warmup=5,
                          max_minutes=self.config.critic_seconds / 60, checkpoint_every=10 ** 6, eval_every=10 ** 6,
                          resume=False, tensorboard=False, progress=False, seed=self.config.seed + int(iteration),
                          imagined=bank, imagined_fraction=self.config.imagined_fraction if bank is not None else 0.0,
                          fit_stats=False)
        critic.eval()
        self._sync_others()
        # rounds up to this one (a later round folder is a round a killed run did not finish)
        done = [d for d in sorted(self.out_dir.glob("round_*"))
                if int(d.name.split("_")[1]) <= int(iteration) and (d / "rollouts.zarr").exists()]
        (self.out_dir / "latest.json").write_text(json.dumps({
            "iteration": int(iteration), "world_model": wm_rep["checkpoint"], "critic": c_rep["checkpoint"],
            "rollout_stores": [str(d / "rollouts.zarr") for d in done]}, indent=2))
        stats = {"refresh/real_success": float(np.mean([e.success for e in eps])),
                 **{f"refresh/real_success/{t}": v for t, v in succ.items()},
                 "refresh/episodes": float(len(eps)), "refresh/onpolicy_episodes": float(len(self.onpolicy)),
                 "refresh/rollout_s": t_roll, "refresh/worldmodel_s": t2 - t1, "refresh/critic_s": time.time() - t2,
                 "refresh/worldmodel_steps": float(wm_rep["steps"]), "refresh/critic_steps": float(c_rep["steps"]),
                 "refresh/wall_s": time.time() - t0}
        log.info("refresh at iteration %d: real success of the current policy %.3f %s; world model %d steps, "
                 "critic %d steps, %.0f s", iteration, stats["refresh/real_success"], succ, wm_rep["steps"],
                 c_rep["steps"], stats["refresh/wall_s"])
        return stats

    def _sync_others(self) -> None:
        """Copy the env's world model and critic weights into the ``also_update`` envs."""
        for other in self.also_update:
            other.world_model.load_state_dict(self.env.world_model.state_dict())
            other.critic.load_state_dict(self.env.critic.state_dict())

    def restore(self) -> int | None:
        """Load the last completed round (``out_dir/latest.json``) into the env's world model and
        critic and reload its on-policy episodes; returns its iteration, also kept in ``restored``
        (``None``: no round yet)."""
        f = self.out_dir / "latest.json"
        if not f.is_file():
            return None
        from safetensors.torch import load_model

        from wmrl.kernel.storage import EpisodeStore

        d = json.loads(f.read_text())
        load_model(self.env.world_model, str(Path(d["world_model"]) / "model.safetensors"))
        load_model(self.env.critic, str(Path(d["critic"]) / "model.safetensors"))
        self.env.world_model.eval()
        self.env.critic.eval()
        self._sync_others()
        self.onpolicy = []
        for p in d["rollout_stores"]:
            st = EpisodeStore.open(p, mode="r")
            self.onpolicy.extend(st.episode(i, self.cameras) for i in range(len(st)))
        self.restored = int(d["iteration"])
        return self.restored

