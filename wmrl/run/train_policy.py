"""``wmrl train-policy``: behaviour cloning of the flow-matching VLA on an EpisodeStore.

    wmrl train-policy store=runs/demos steps=2500 hydra.run.dir=runs/bc
    wmrl train-policy store=runs/demos policy=tiny steps=50          # debug

Builds the policy from ``cfg.policy`` (a ``_target_``; ``null`` fields are taken from the store's
metadata), sets its normalisation statistics from the training episodes (``store.stats()`` is over
all episodes; the held-out validation episodes are few), trains with
:func:`policies.train.train_bc` (chunk windows with padding masks, EMA, TensorBoard scalars under
``<run>/tb``, checkpoints under ``<run>/checkpoints/{step_<n>,last}``, resumes from ``last``) and
writes ``report.json``. The checkpoint loads with ``wmrl.kernel.checkpoint.load_checkpoint``.
"""

from __future__ import annotations

import logging

import hydra
import numpy as np
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.train_policy")


def policy_for_store(policy_cfg: DictConfig | dict, store) -> object:
    """Instantiate ``policy_cfg`` with ``null`` fields filled from ``store.meta``."""
    pc = OmegaConf.to_container(policy_cfg, resolve=True) if OmegaConf.is_config(policy_cfg) else dict(policy_cfg)
    cams = store.cameras
    if pc.get("cameras") is None:
        pc["cameras"] = list(cams)
    missing = [c for c in pc["cameras"] if c not in cams]
    if missing:
        raise ValueError(f"policy.cameras {missing} are not in the store (it has {list(cams)})")
    if pc.get("image_size") is None:
        sizes = {tuple(cams[c]) for c in pc["cameras"]}
        if len(sizes) != 1:
            raise ValueError(f"the store's cameras have different sizes {sizes}; set policy.image_size and "
                             "use cameras of one size")
        pc["image_size"] = list(sizes.pop())
    for key, val in (("state_dim", store.state_dim), ("action_dim", store.action_dim),
                     ("action_space", store.action_space.to_dict())):
        if pc.get(key) is None:
            pc[key] = val
    if pc["state_dim"] != store.state_dim or pc["action_dim"] != store.action_dim:
        raise ValueError(f"policy dims (state {pc['state_dim']}, action {pc['action_dim']}) differ from the "
                         f"store's ({store.state_dim}, {store.action_dim})")
    return instantiate(pc, _convert_="all")


def uses_chunk_frame(policy_cfg, store) -> bool:
    """Whether the policy config's ``relative_actions`` (``auto`` / bool) puts its chunks in the chunk
    frame for this store's action space (``policies.action_frames.resolve``)."""
    from policies.action_frames import resolve

    return resolve(policy_cfg.get("relative_actions", False), store.action_space)


def chunk_frame_stats(store, chunk_size: int):
    """Normalisation statistics of a ``relative_actions`` policy: the store's proprio, and its
    actions in the chunk frame of every window (``policies.action_frames.chunk_frame_samples``)."""
    from policies.action_frames import chunk_frame_samples
    from wmrl.kernel.storage.normalize import NormStats

    eps = [(store.array(i, "proprio"), store.array(i, "actions")) for i in range(len(store))]
    return NormStats.from_data({"proprio": np.concatenate([p for p, _ in eps]),
                                "actions": chunk_frame_samples(eps, chunk_size)})


def cap_episodes_per_task(episodes: np.ndarray, task_names, cap) -> np.ndarray:
    """Keep the first ``cap`` of ``episodes`` (store order) of each task.

    ``cap``: ``None`` (keep all), an int for every task, or a mapping ``{task: int}`` (tasks not named
    are kept whole). Raises ``ValueError`` for a negative cap or a task the store does not have."""
    if cap is None:
        return episodes
    if isinstance(cap, (int, np.integer)):
        caps = {t: int(cap) for t in set(task_names)}
    else:
        caps = {str(k): int(v) for k, v in dict(cap).items()}
        unknown = sorted(set(caps) - set(task_names))
        if unknown:
            raise ValueError(f"episodes_per_task names tasks {unknown} that the store does not have "
                             f"(it has {sorted(set(task_names))})")
    if any(v < 0 for v in caps.values()):
        raise ValueError(f"episodes_per_task must be >= 0, got {caps}")
    seen: dict[str, int] = {}
    keep = []
    for e in episodes:
        t = task_names[e]
        seen[t] = seen.get(t, 0) + 1
        if t not in caps or seen[t] <= caps[t]:
            keep.append(int(e))
    return np.asarray(keep, dtype=np.int64)


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from policies.train import train_bc
    from wmrl.kernel.storage import EpisodeStore, WindowDataset

    if cfg.get("store") in (None, "", "???"):
        raise ValueError("train-policy needs store=PATH (an EpisodeStore folder, e.g. from `wmrl collect`)")
    store = EpisodeStore.open(ctx.path(cfg.store), mode="r")
    if len(store) == 0:
        raise ValueError(f"the store {cfg.store} has no episodes")
    policy = policy_for_store(cfg.policy, store).to(cfg.device)
    policy.set_norm_stats(chunk_frame_stats(store, policy.chunk_size) if uses_chunk_frame(cfg.policy, store)
                          else store.stats())

    episodes = np.arange(len(store))
    if cfg.get("only_successful"):
        episodes = episodes[store.successes[episodes]]
    if cfg.get("tasks"):
        keep = set(cfg.tasks)
        names = store.task_names
        episodes = np.asarray([e for e in episodes if names[e] in keep], dtype=np.int64)
    episodes = cap_episodes_per_task(episodes, store.task_names, cfg.get("episodes_per_task"))
    if len(episodes) == 0:
        raise ValueError("no episodes left after the only_successful / tasks / episodes_per_task filters")
    n = int(cfg.get("val_every_nth_episode") or 0)
    val_eps = episodes[::n] if n > 0 and len(episodes) >= 2 * n else episodes[:0]
    train_eps = np.setdiff1d(episodes, val_eps)
    h = policy.chunk_size
    cams = list(policy.cameras)
    train_ds = WindowDataset(store, n_obs=1, horizon=h, cameras=cams, episodes=train_eps.tolist(), progress=True)
    val_ds = WindowDataset(store, n_obs=1, horizon=h, cameras=cams, episodes=val_eps.tolist()) if len(val_eps) else None
    from policies.text import encode_instructions

    encode_instructions(sorted({store.instructions[e] for e in episodes}))  # load the frozen encoder, cache
    log.info("BC on %d train episodes (%d windows), %d validation episodes", len(train_eps), len(train_ds), len(val_eps))
    report = train_bc(policy, train_ds, cfg.train, ctx.out_dir, val_dataset=val_ds)
    names = store.task_names
    report.update(store=str(ctx.path(cfg.store)), train_episodes=int(len(train_eps)), val_episodes=int(len(val_eps)),
                  train_windows=len(train_ds), tasks=sorted({names[e] for e in episodes}),
                  instructions=sorted({store.instructions[e] for e in episodes}))
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="train_policy")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "train-policy")


if __name__ == "__main__":
    main()
