"""``wmrl imagination-check``: before GRPO, does a world model + critic rank a policy's rollouts like
the sim? The policy (with GRPO's RL sampler or latent-noise steering) is rolled out in imagination in
groups from GRPO's first train init states (and, with ``keyframes_per_task``, from keyframes of GRPO's
``starts.store`` as GRPO draws them), and the same actions are replayed open loop in the sim
(:func:`wmrl.fidelity.replay_check`). The pipeline's ``imagination_check`` stage.

Report: imagined and replayed success, within-group pair accuracy, precision of imagined successes,
mixed groups, per task (``wmrl.fidelity.replay_check``), and the sampler used.
"""

from __future__ import annotations

import logging
from functools import partial

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.imagination_check")


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from wmrl.fidelity import replay_check
    from wmrl.rl.starts import ContextStarts, InitStateStarts, KeyframeStarts
    from wmrl.run.builders import (
        build_suite,
        load_policy,
        make_imagination_env,
        make_sim_env,
        rl_policy,
        train_n_init,
        with_suite,
    )

    suite_cfg = OmegaConf.to_container(cfg.suite, resolve=True)
    if cfg.get("tasks"):
        suite_cfg["tasks"] = list(cfg.tasks)
    suite = build_suite(suite_cfg)
    tasks = {t: suite.instruction(t) for t in suite.task_names}
    g = cfg.grpo
    policy, policy_cfg = load_policy(ctx.path(cfg.checkpoint), str(cfg.device))
    policy, _, rl_sampler = rl_policy(policy, policy_cfg, g, str(cfg.device))
    policy.eval()
    if rl_sampler is not None:
        policy.sampler = rl_sampler
    group = int(g.group_size)
    n_init = train_n_init(OmegaConf.create({"n_init": g.get("n_init")}), suite, tasks)
    per_task, keyframes = int(cfg.starts_per_task), int(cfg.get("keyframes_per_task") or 0)
    if per_task < 0 or keyframes < 0 or per_task + keyframes == 0:
        raise ValueError(f"the imagination check needs starts: starts_per_task={per_task} and keyframes_per_task="
                         f"{keyframes} (both >= 0, at least one > 0)")
    if keyframes and not cfg.get("store"):
        raise ValueError("keyframes_per_task > 0 needs store=<EpisodeStore with sim states> (GRPO's starts.store, "
                         "e.g. the pipeline's bc_rollouts/demos_and_rollouts.zarr)")
    sim_env = make_sim_env(int(cfg.num_envs), suite=suite)        # renders the context frames, then replays
    starts = []
    if per_task:
        starts = InitStateStarts(tasks, n_init=n_init, per_task=per_task, split="train", seed=int(cfg.seed))(0)
        starts = ContextStarts(None, sim_env).contextualize(starts)
    if keyframes:   # mid-episode real frames with their MuJoCo states, drawn as GRPO draws its keyframe starts
        kf = KeyframeStarts(ctx.path(cfg.store), tasks, keyframes, seed=int(cfg.seed),
                            first_steps=cfg.get("first_steps"), success_fraction=cfg.get("success_fraction"))(0)
        if any(s.sim_state is None for s in kf):
            raise ValueError(f"store {cfg.store} holds no sim states: its keyframes cannot be replayed in the sim")
        starts = starts + kf
    kw = with_suite(OmegaConf.to_container(g.env.get("imagination"), resolve=True) or {}, suite)
    imag = make_imagination_env(str(ctx.path(g.env.world_model)), str(ctx.path(g.env.critic)), len(starts) * group,
                                seed=int(cfg.seed), device=str(cfg.device), **kw)
    workers = max(1, int(cfg.get("workers") or 1))
    make_replay_env = partial(replay_env, suite_cfg, int(cfg.num_envs))
    r = replay_check(imag, make_replay_env() if workers == 1 else None, policy, starts, group, int(g.max_chunks),
                     generator=torch.Generator().manual_seed(int(cfg.seed)), progress=True,
                     keep_rollouts=True, workers=workers, make_env=make_replay_env)
    r["object_moves"] = save_rollouts(ctx.out_dir / "rollouts.npz", r.pop("rollouts"), suite)
    r["sampler"] = repr(policy.sampler)  # the RL sampler, or the latent-noise steering's
    r.update(imag.counters())   # grasp_misses: closes the grasp box judged misses; halted: slots the uncertainty gate halted
    _log_verdict(r)
    return r


def replay_env(suite_cfg: dict, num_envs: int):
    """The sim env the check replays in: the suite's, without cameras (an open-loop replay needs
    no frames; rendering them was about a quarter of its time)."""
    from wmrl.run.builders import build_suite

    return build_suite(suite_cfg).make_env(int(num_envs), cameras=())


def save_rollouts(path, ro: dict, suite) -> dict:
    """Write the check's rollouts (``wmrl.fidelity.replay_check``'s ``rollouts``) to ``path`` (``.npz``:
    ``task``, ``kind`` (``init`` / ``keyframe``), ``group``, ``imagined``, ``replayed`` ``(M,)``;
    ``gripper`` ``(M, N)`` and chunk-end proprio ``imagined_ends`` / ``replayed_ends`` ``(M, N, D_s)``,
    NaN past each rollout's end; ``actions`` ``(M, N, H, D_a)`` (the chunks imagined and replayed,
    NaN past the end), ``init_index`` ``(M,)`` (-1: none), ``split`` and ``start_state`` ``(M, S)``
    (the start's flattened MuJoCo state, NaN where the start has none and past its size: scenes
    differ), so a rollout can be replayed again; ``imagined_uncertainty`` ``(M, N)``, the world
    model's disagreement after each imagined chunk (m for the dynamics ensemble; NaN where the env
    gave none); ``object_start`` / ``object_end`` ``(M, 3)`` m, the task object where the start put it
    and after the replay's last chunk, NaN where unknown) and return, per task and outcome, how far the replay moved the task object up: ``{task: {"imagined_only" | "neither":
    {"n", "rise_cm_median", "rise_cm_q90"}}}`` (a replay that ended in success has no end state).

    The end state's object is read by an ``ObjectLocatingSuite`` (``sim.suite.Suite.object_position``);
    another suite gives NaN."""
    import numpy as np

    from wmrl.kernel.interfaces import ObjectLocatingSuite
    from wmrl.kernel.types import Start

    m = len(ro["starts"])
    n = max(len(g) for g in ro["gripper"])
    d = ro["imagined_ends"][0].shape[-1]
    grip = np.full((m, n), np.nan, np.float32)
    im_e, re_e = np.full((m, n, d), np.nan, np.float32), np.full((m, n, d), np.nan, np.float32)
    unc = np.full((m, n), np.nan, np.float32)
    acts = np.full((m, n, *ro["actions"][0].shape[1:]), np.nan, np.float32)
    size = max((len(np.asarray(st.sim_state)) for st in ro["starts"] if st.sim_state is not None), default=0)
    start_state = np.full((m, size), np.nan)
    o0, o1 = np.full((m, 3), np.nan), np.full((m, 3), np.nan)
    locate = isinstance(suite, ObjectLocatingSuite)
    uncertainty = ro.get("imagined_uncertainty") or [None] * m
    for i, st in enumerate(ro["starts"]):
        g = ro["gripper"][i].numpy()
        grip[i, :len(g)] = g
        a, b = ro["imagined_ends"][i].numpy(), ro["replayed_ends"][i].numpy()
        im_e[i, :len(a)], re_e[i, :len(b)] = a, b
        acts[i, :len(ro["actions"][i])] = ro["actions"][i].numpy()
        if st.sim_state is not None:     # NaN-padded: starts in another scene have another state size
            state = np.asarray(st.sim_state, dtype=np.float64)
            start_state[i, :len(state)] = state
        u = uncertainty[i]
        if u is not None:
            unc[i, :len(u)] = u.numpy()
        if locate:
            p0 = suite.object_position(st)
            o0[i] = p0 if p0 is not None else np.nan
            state = ro["replayed_end_state"][i]
            if state is not None:
                o1[i] = suite.object_position(Start(task_name=st.task_name, instruction=st.instruction,
                                                    sim_state=np.asarray(state)))
    tasks = np.asarray([s.task_name for s in ro["starts"]])
    kinds = np.asarray(ro["kind"])
    im, re = np.asarray(ro["imagined"], bool), np.asarray(ro["replayed"], bool)
    np.savez_compressed(path, task=tasks, kind=kinds, group=np.asarray(ro["group"]), imagined=im, replayed=re,
                        gripper=grip, imagined_ends=im_e, replayed_ends=re_e, imagined_uncertainty=unc,
                        object_start=o0, object_end=o1, actions=acts, start_state=start_state,
                        init_index=np.asarray([-1 if st.init_index is None else int(st.init_index) for st in ro["starts"]]),
                        split=np.asarray([st.split for st in ro["starts"]]))
    rise = 100 * (o1[:, 2] - o0[:, 2])
    out = {}
    for t in dict.fromkeys(tasks.tolist()):
        out[t] = {}
        for name, sel in (("imagined_only", im & ~re), ("neither", ~im & ~re)):
            k = sel & (tasks == t) & np.isfinite(rise)
            out[t][name] = {"n": int(k.sum()),
                            "rise_cm_median": round(float(np.median(rise[k])), 2) if k.any() else None,
                            "rise_cm_q90": round(float(np.quantile(rise[k], 0.9)), 2) if k.any() else None}
    return out


def _log_verdict(r: dict) -> None:
    acc_s = "n/a (no group with both outcomes in the sim)" if r["pair_accuracy"] is None else f"{r['pair_accuracy']:.2f} (0.5 = chance)"
    log.info("imagination check: imagined success %.3f, the same actions replayed in the sim %.3f; within-group "
             "pair accuracy %s, %d/%d groups mixed in imagination, %d in the sim",
             r["imagined_success"], r["replayed_success"], acc_s, r["mixed_groups_imagined"],
             r["groups"], r["mixed_groups_real"])
    w = r.get("outcome_paths", {}).get("imagined_only")
    if w and w["n"]:
        log.info("imagination check: %d imagined successes fail in the sim; at their last chunk the imagined end "
                 "effector is %.2f cm (median) from the replayed one (%d over 2 cm), finger gap %.2f cm imagined vs "
                 "%.2f cm replayed", w["n"], w["ee_err_cm_median"], w["far"], w["gap_imagined_cm_median"],
                 w["gap_replayed_cm_median"])
    acc, prec = r["pair_accuracy"], r["precision"]
    if (acc is not None and acc < 0.6) or (prec is not None and prec < 0.5):
        log.warning("imagination check: the world model and critic reward actions that fail in the sim (pair "
                    "accuracy %s, precision of imagined successes %s); GRPO in imagination is unlikely to improve "
                    "real success. Train the world model longer or on more episodes (stages.worldmodel), or "
                    "compare with env=sim (wmrl bench grpo)", acc, prec)


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="imagination_check")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "imagination_check")


if __name__ == "__main__":
    main()
