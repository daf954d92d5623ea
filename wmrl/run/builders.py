"""Builders shared by the entry points (a non-entry module of ``wmrl.run``): the only place where
components (``sim``, ``worldmodels``, ``policies``) are put together with the engine (``wmrl.rl``,
``wmrl.imagination``, ``wmrl.evaluation``).

* policies: :func:`load_policy`, :func:`rl_policy` / :func:`steered_policy`, :func:`using_sampler`,
  :func:`trainable_parameters`, :func:`build_actor` (for evaluation workers);
* environments: :func:`make_sim_env`, :func:`make_imagination_env`, the env configs' ``_target_``s
  :func:`sim_chunk_env` / :func:`imagination_chunk_env`,
  :func:`build_env` (GRPO's ChunkEnv), :func:`build_suite`, :func:`task_instructions`,
  :func:`train_n_init`;
* evaluation: :func:`evaluate_real` (real-sim success on held-out init states).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from wmrl.kernel.interfaces import SamplerPolicy


def task_instructions(tasks: Any) -> dict[str, str]:
    """``tasks`` as a dict ``name -> instruction``; a list of names is resolved from the sim suite."""
    if isinstance(tasks, (dict, DictConfig)):
        return {str(k): str(v) for k, v in dict(tasks).items()}
    names = [str(t) for t in tasks]
    if not names:
        raise ValueError("tasks is empty: give a list of suite task names, e.g. tasks=[lift_red,lift_green]")
    from sim.tasks import get_task

    return {n: get_task(n).instruction for n in names}


def make_sim_env(num_envs: int, suite=None, tasks=None, **suite_kwargs):
    """The real simulator as a ChunkEnv: ``sim.suite.Suite(...).make_env(num_envs)``.

    ``suite``: a ``Suite`` (or ``None`` to build one from ``tasks`` and ``suite_kwargs``)."""
    if suite is None:
        from sim.suite import Suite

        suite = Suite(tasks=list(tasks) if tasks else None, **suite_kwargs)
    return suite.make_env(int(num_envs))


def precision_report(env, policy) -> dict:
    """What GRPO computed in: the policy always in fp32 (its log-prob ratios would be bf16 noise
    otherwise), the world model of an imagination env at its own resolved precision (``wmrl.kernel.precision``)."""
    from wmrl.kernel.precision import Precision

    out = {"policy": Precision.fixed_fp32(next(policy.parameters()).device,
                                          "GRPO: policy log-probs and ratios are computed in fp32").as_dict()}
    from wmrl.imagination import ImaginationEnv

    if isinstance(env, ImaginationEnv) and callable(getattr(env.world_model, "precision", None)):
        out["world_model"] = env.world_model.precision().as_dict()
    return out


def make_imagination_env(world_model: str, critic: str, num_envs: int, seed: int = 0, device: str = "cpu", **kwargs):
    """``wmrl.imagination.ImaginationEnv`` from world-model and critic checkpoint folders; a
    ``proprio_success`` dict (``tasks``, ``closed_steps``, ``gap_min_m``, ``rise_min_m``) becomes its
    ``ProprioLiftRule`` (``None`` or no ``tasks``: none)."""
    from wmrl.imagination import ImaginationEnv, ProprioLiftRule
    from wmrl.kernel.checkpoint import load_checkpoint

    wm = load_checkpoint(world_model, map_location=device).eval()
    cr = load_checkpoint(critic, map_location=device).eval()
    rule = kwargs.pop("proprio_success", None)
    if isinstance(rule, dict) and rule.get("tasks"):
        kwargs["proprio_success"] = ProprioLiftRule(**rule)
    return ImaginationEnv(wm, cr, num_envs=int(num_envs), seed=int(seed), **kwargs)


def with_suite(options: dict, suite) -> dict:
    """``options`` of an ImaginationEnv completed from the ``suite`` it imagines: ``max_steps=
    suite.max_steps`` (the tasks' step limits, unless ``task_step_limits: false`` or no suite),
    ``start_objects=suite.object_position`` when ``proprio_success`` has a ``grasp_box_m`` (the box
    needs where each start's object is), and ``start_goals=suite.goal_position`` when it has a
    ``place_box_m`` (where each start's goal object is).

    Raises:
        ValueError: a grasp or place box without a suite, or with a suite that cannot say where
            objects (``ObjectLocatingSuite``) or goals (``GoalLocatingSuite``) are.
    """
    from wmrl.kernel.interfaces import GoalLocatingSuite, ObjectLocatingSuite

    options = dict(options)
    if options.pop("task_step_limits", True) and suite is not None:
        options["max_steps"] = suite.max_steps
    rule = options.get("proprio_success") or {}
    if not (isinstance(rule, dict) and rule.get("tasks")):
        return options
    for key, capability, what, option, method in (
            ("grasp_box_m", ObjectLocatingSuite, "object", "start_objects", "object_position"),
            ("place_box_m", GoalLocatingSuite, "goal object", "start_goals", "goal_position")):
        if rule.get(key) is None:
            continue
        if not isinstance(suite, capability):
            raise ValueError(f"proprio_success.{key} needs a suite that says where each start's {what} is (the "
                             f"{capability.__name__} capability); {type(suite).__name__} does not: set "
                             f"proprio_success.{key}=null")
        options[option] = getattr(suite, method)
    return options


@contextmanager
def using_sampler(policy, sampler):
    """Temporarily replace ``policy.sampler`` (no-op when ``sampler`` is None or the policy has none)."""
    if sampler is None or not isinstance(policy, SamplerPolicy):
        yield policy
        return
    old = policy.sampler
    policy.sampler = sampler
    try:
        yield policy
    finally:
        policy.sampler = old


def steered_policy(policy, policy_cfg: dict, steer: DictConfig | None, device: str = "cpu"):
    """With ``steer.enabled``: wrap a flow policy in ``policies.steering.LatentNoisePolicy`` (DSRL: GRPO
    trains only a latent-noise head; a checkpoint that already is one is kept) and return it with its
    checkpoint config and its RL sampler ``LatentNoiseSampler(steer.std)``. Otherwise the inputs and
    ``None`` (the caller's ``rl_sampler``)."""
    from policies.steering import LatentNoisePolicy, LatentNoiseSampler

    if steer is None or not bool(steer.get("enabled", False)):
        if isinstance(policy, LatentNoisePolicy):
            raise ValueError("the checkpoint is a latent-noise-steered policy (LatentNoisePolicy): set steer.enabled=true "
                             "to post-train it (or start from its BC checkpoint)")
        return policy, policy_cfg, None
    if float(steer.std) <= 0:
        raise ValueError(f"steer.std must be > 0 for RL (the exploration std of the latent noise), got {steer.std}; "
                         "std 0 is the deterministic evaluation sampler")
    if isinstance(policy, LatentNoisePolicy):
        have = {"hidden": policy.init_config["hidden"], "bound": policy.bound, "residual_bound": policy.residual_bound}
        want = {"hidden": int(steer.hidden), "bound": float(steer.bound),
                "residual_bound": float(steer.get("residual_bound", 0.0))}
        if have != want:
            raise ValueError(f"the checkpoint's noise head has {have}, steer asks for {want}: drop those overrides "
                             "to continue it, or start from the BC checkpoint for a new head")
    else:
        policy = LatentNoisePolicy(policy, hidden=int(steer.hidden), bound=float(steer.bound),
                                   sampler=LatentNoiseSampler(0.0, int(steer.num_steps)),
                                   residual_bound=float(steer.get("residual_bound", 0.0)),
                                   residual_dims=steer.get("residual_dims")).to(device)
    rstd = steer.get("residual_std")
    return policy, policy.checkpoint_config(), LatentNoiseSampler(float(steer.std), int(steer.num_steps),
                                                                  None if rstd is None else float(rstd))


def rl_policy(policy, policy_cfg: dict, cfg: DictConfig, device: str = "cpu"):
    """The policy GRPO trains and its RL sampler from a post-train config: the latent-noise steering
    (``cfg.steer``, :func:`steered_policy`) when enabled, else ``cfg.rl_sampler`` instantiated (or
    ``None``). Returns ``(policy, checkpoint config, rl_sampler)``."""
    policy, policy_cfg, rl_sampler = steered_policy(policy, policy_cfg, cfg.get("steer"), device)
    if rl_sampler is None and cfg.get("rl_sampler"):
        rl_sampler = instantiate(cfg.rl_sampler)
    return policy, policy_cfg, rl_sampler


def load_policy(path, device: str = "cpu"):
    """Policy checkpoint -> ``(policy, constructor config dict)``."""
    from wmrl.kernel.checkpoint import load_checkpoint, read_checkpoint_config

    cfg = read_checkpoint_config(path)
    return load_checkpoint(path, map_location=device), cfg


def sim_chunk_env(num_envs: int, suite=None, workers: int = 1, **labels):
    """``configs/env/sim.yaml``'s ``_target_``: the suite's SimEnv with ``num_envs`` slots; with
    ``workers > 1`` its slots split over that many Ray actors (``wmrl.kernel.workers.RayChunkEnv``,
    the same rollouts). ``labels``: the env config's other keys (``name``, ``context_starts``,
    ``seed``, ``device``), which the SimEnv does not take. Raises ``ValueError`` without a suite or
    with ``workers > num_envs``."""
    if suite is None:
        raise ValueError("env=sim needs a suite (suite=default)")
    if int(workers) > 1:
        from wmrl.kernel.workers import RayChunkEnv

        return RayChunkEnv(suite.make_env, int(num_envs), int(workers))
    return make_sim_env(int(num_envs), suite=suite)


def imagination_replica(world_model: str, critic: str, seed: int, device: str, options: dict, num_envs: int,
                        replica: int):
    """Replica ``replica`` of a served imagination (:func:`imagination_chunk_env` with ``replicas > 1``):
    an ImaginationEnv of ``num_envs`` slots whose sampling seed is ``seed + 1_000_003 * replica`` (the
    replicas do not draw the same noise), on ``device`` (``"cuda"``: the actor's own GPU)."""
    return make_imagination_env(world_model, critic, int(num_envs), seed=int(seed) + 1_000_003 * int(replica),
                                device=device, **dict(options))


def imagination_chunk_env(world_model: str, critic: str, num_envs: int, imagination: dict | None = None,
                          seed: int = 0, device: str = "cpu", replicas: int = 1, gpus_per_replica: float = 0.0,
                          **labels):
    """``configs/env/imagination.yaml``'s ``_target_``: an ImaginationEnv from world-model and critic
    checkpoint folders (:func:`make_imagination_env`); ``imagination``: its options. ``labels``: the
    env config's other keys (``name``, ``context_starts``, ``context_num_envs``, ``suite``).

    ``replicas > 1``: imagination served by that many world-model replicas, Ray actors (on the
    cluster ``ray.address`` names; ``gpus_per_replica`` GPUs each), each holding the world model and
    the critic and stepping its contiguous share of the learner's ``num_envs`` slots in one batched
    call per chunk (:class:`wmrl.kernel.workers.RayChunkEnv`, ``indexed``; seeds per replica,
    :func:`imagination_replica`). A deterministic world model gives the one-replica rollouts; a
    sampling one gives other (equally distributed) samples than one replica, the same for the same
    number of replicas. The replicas' world models are not the learner's: world-model refresh
    (``refresh.every``) needs ``replicas=1``.

    Raises ``ValueError`` when a checkpoint path is missing or ``replicas > num_envs``."""
    for k, v in (("world_model", world_model), ("critic", critic)):
        if v in (None, "", "???"):
            raise ValueError(f"env=imagination needs env.{k}=PATH (a {k} checkpoint folder)")
    kw = OmegaConf.to_container(imagination, resolve=True) if OmegaConf.is_config(imagination) else dict(imagination or {})
    kw = with_suite(kw, labels.get("suite"))
    if int(replicas) > 1:
        import functools

        from wmrl.kernel.workers import RayChunkEnv

        make = functools.partial(imagination_replica, str(world_model), str(critic), int(seed),
                                 "cuda" if float(gpus_per_replica) > 0 else device, kw)
        return RayChunkEnv(make, int(num_envs), int(replicas), num_gpus=float(gpus_per_replica), indexed=True)
    return make_imagination_env(str(world_model), str(critic), int(num_envs), seed=seed, device=device, **kw)


# keys of an env config that describe how the roots use the env, not how it is built
_ENV_USE_KEYS = ("chunk_env", "context_env")


def build_env(env_cfg: DictConfig, suite, seed: int = 0, device: str = "cpu"):
    """GRPO's ChunkEnv: ``env_cfg.chunk_env`` (any ``_target_``) if given, else ``env_cfg`` itself
    instantiated through its ``_target_`` (``configs/env/*.yaml``: :func:`sim_chunk_env`,
    :func:`imagination_chunk_env`, or a new env's own factory) with ``suite``, ``seed`` and ``device``.
    Raises ``ValueError`` for a config without ``_target_``."""
    if env_cfg.get("chunk_env"):
        return instantiate(env_cfg.chunk_env, seed=seed) if "seed" in env_cfg.chunk_env else instantiate(env_cfg.chunk_env)
    if not env_cfg.get("_target_"):
        raise ValueError("the env config needs a _target_ (a ChunkEnv factory, e.g. wmrl.run.builders.sim_chunk_env) "
                         "or chunk_env: {_target_: ...}")
    spec = {k: v for k, v in OmegaConf.to_container(env_cfg, resolve=True).items() if k not in _ENV_USE_KEYS}
    return instantiate(spec, suite=suite, seed=seed, device=device, _recursive_=False)


def evaluate_real(policy, tasks: dict, episodes_per_task: int, num_envs: int, seed: int, suite=None, env=None,
                  max_chunks: int = 20, out_dir=None, videos_per_task: int = 0, progress: bool = False,
                  workers: int = 1, make_actor=None, make_suite=None) -> dict:
    """Real-sim success on held-out init states ``0..episodes_per_task-1`` of every task.

    With a ``suite``: :func:`wmrl.evaluation.evaluate_policy` (per-episode seeds, videos; ``workers``
    processes with ``make_actor`` / ``make_suite`` as there); with an
    explicit ``env`` (tests, custom envs): :func:`wmrl.rl.evaluate.evaluate_success`. Returns
    ``{"success", "ci95", "n", "per_task": {task: {"success", "ci95", "n"}}}``."""
    if env is not None or suite is None:
        if env is None:
            raise ValueError("evaluation needs a suite or evaluation.env")
        from wmrl.rl.evaluate import evaluate_success
        from wmrl.rl.starts import all_starts

        r = evaluate_success(env, policy, all_starts(tasks, episodes_per_task, split="eval"), max_chunks,
                             seed=seed, progress=progress)
        r.pop("episodes", None)
        return r
    from wmrl.evaluation import evaluate_policy

    rep = evaluate_policy(policy, suite, episodes_per_task=episodes_per_task, batch_size=num_envs, seed=seed,
                          out_dir=out_dir, videos_per_task=videos_per_task, tasks=list(tasks), progress=progress,
                          workers=workers, make_actor=make_actor, make_suite=make_suite)
    out = {"success": rep["overall"]["success_rate"], "ci95": rep["overall"]["ci95"], "n": rep["overall"]["episodes"],
           "per_task": {t: {"success": v["success_rate"], "ci95": v["ci95"], "n": v["episodes"],
                            "mean_length": v["mean_length"]} for t, v in rep["tasks"].items()}}
    if "videos" in rep:
        out["videos"] = rep["videos"]
    return out


def train_n_init(starts_cfg: DictConfig, suite, tasks) -> int:
    """Train init states per task that GRPO's starts draw from: ``starts.n_init``, or (null) the
    fewest the suite stores for any of ``tasks``."""
    return int(starts_cfg.get("n_init") or min(suite.num_init_states(t, "train") for t in tasks))


def trainable_parameters(policy, prefixes) -> list:
    """The parameters GRPO updates: all that require grad (``prefixes`` null), or only those whose
    name starts with one of ``prefixes`` (e.g. ``[head]``: the flow-matching action head; the vision
    and language encoders stay as BC left them). The others are frozen (``requires_grad=False``).

    Raises:
        ValueError: no parameter matches ``prefixes`` (the message lists the top-level modules)."""
    if not prefixes:
        return [p for p in policy.parameters() if p.requires_grad]
    prefixes = tuple(str(x) for x in prefixes)
    keep = []
    for name, p in policy.named_parameters():
        if name.startswith(prefixes):
            keep.append(p)
        else:
            p.requires_grad_(False)
    if not keep:
        tops = sorted({n.split(".")[0] for n, _ in policy.named_parameters()})
        raise ValueError(f"trainable={list(prefixes)} matches no parameter of the policy; its modules are {tops}")
    return keep


class InstructionOverride:
    """A policy that is given ``instruction`` instead of the task's own (instruction-following
    checks: same scene and success test, other words). Forwards everything else to ``policy``."""

    def __init__(self, policy, instruction: str):
        self.policy, self.instruction = policy, str(instruction)
        self.chunk_size, self.action_dim = policy.chunk_size, policy.action_dim

    def sample(self, obs, generator=None):
        from wmrl.kernel.types import Obs

        return self.policy.sample(Obs(obs.images, obs.proprio, [self.instruction] * obs.batch_size), generator)

    def __getattr__(self, name):
        return getattr(self.policy, name)


def build_suite(suite_cfg: dict):
    """The suite from its (resolved) config dict: picklable with ``functools.partial`` for workers."""
    return instantiate(suite_cfg)


def build_actor(checkpoint: str, noise: float, suite_cfg: dict, device: str = "cpu", sampler_cfg: dict | None = None,
                instruction: str | None = None):
    """The scripted expert (``checkpoint="expert"``) or the policy in a checkpoint folder (in eval
    mode, with ``sampler_cfg`` instantiated as its sampler when given, and given ``instruction``
    instead of the task's when set), for worker processes."""
    if checkpoint == "expert":
        if instruction:
            raise ValueError("instruction= applies to a policy checkpoint; the scripted expert reads no instruction")
        return build_suite(suite_cfg).make_expert(float(noise))
    from wmrl.kernel.checkpoint import load_checkpoint

    policy = load_checkpoint(checkpoint, map_location=device)
    if isinstance(policy, nn.Module):
        policy.eval()
    if sampler_cfg:
        policy.sampler = instantiate(sampler_cfg)
    return InstructionOverride(policy, instruction) if instruction else policy
