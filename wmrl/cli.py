"""The ``wmrl`` console command: dispatches a subcommand to its Hydra entry point in ``wmrl/run/``.

``wmrl <subcommand> [hydra overrides...]``, e.g. ``wmrl import source=demo.hdf5 hydra.run.dir=runs/x``.
``wmrl bench <what>`` runs the benchmark ``bench_<what>``.

This table is the single list of subcommands: name -> (module in ``wmrl.run``, one-line help).
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "pipeline": ("pipeline", "main job: demos -> BC -> world model + critic -> GRPO in imagination -> real-sim evaluation"),
    "import": ("import_data", "import episodes (robomimic/robosuite demo.hdf5, LeRobotDataset v3 folder) into an EpisodeStore"),
    "export": ("export_data", "export an EpisodeStore to a LeRobotDataset v3 folder"),
    "collect": ("collect", "run the scripted experts of the sim suite and write their episodes to an EpisodeStore"),
    "evaluate": ("evaluate", "evaluate a policy checkpoint or the scripted expert on the sim suite (success, CI, videos)"),
    "train-policy": ("train_policy", "behaviour cloning of the flow-matching VLA policy on an EpisodeStore"),
    "train-worldmodel": ("train_worldmodel", "train the action-conditioned video world model on an EpisodeStore"),
    "train-critic": ("train_critic", "train the progress-value critic on an EpisodeStore"),
    "evaluate-worldmodel": ("evaluate_worldmodel", "world-model fidelity: PSNR/SSIM per horizon, action following, critic AUROC"),
    "imagination-check": ("imagination_check", "before GRPO: a policy's imagined rollouts replayed in the sim (does imagination reward what works?)"),
    "post-train": ("post_train", "GRPO post-training of a policy in imagination (env=imagination) or in the sim (env=sim)"),
    "robot": ("robot", "MuJoCo arm node: plays the robot in real time for the robot bridge"),
    "serve": ("serve", "policy server for the robot bridge"),
    "refine": ("refine", "fine-tune the world model and critic on recorded failures and report the fidelity change"),
    "doctor": ("doctor", "what this machine has and wmrl will choose (precision, threads, renderer), and the pipeline's estimated time"),
    "torchrun": ("", "data-parallel training on this machine: `wmrl torchrun [--nproc-per-node N] train-policy|train-worldmodel|train-critic ...` (loopback only)"),
    "bench": ("bench", "benchmarks: `wmrl bench sim|imagination|policy|grpo|bridge|dynamics|scale`"),
}

BENCHES = ("sim", "imagination", "policy", "grpo", "bridge", "dynamics", "scale")


def _usage() -> str:
    width = max(len(k) for k in SUBCOMMANDS)
    lines = ["usage: wmrl <subcommand> [key=value ...]  (Hydra overrides; `wmrl <subcommand> --help` for its config)", "", "subcommands:"]
    for name, (_, help_) in SUBCOMMANDS.items():
        lines.append(f"  {name:<{width}}  {help_}")
    lines += ["", "Every run writes config.yaml (resolved), report.json and its log into its run directory",
              "(set it with hydra.run.dir=PATH)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"wmrl: unknown subcommand {name!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    from wmrl.kernel.workers import die_with_parent_from_env

    die_with_parent_from_env()  # a child command (started with wmrl.kernel.workers.child_env) dies with its parent
    if name == "torchrun":
        from wmrl.kernel.distributed import launch

        try:
            return launch(rest, commands=set(SUBCOMMANDS))
        except ValueError as e:
            print(f"wmrl torchrun: {e}", file=sys.stderr)
            return 2
    module_name = SUBCOMMANDS[name][0]
    if name == "bench":
        if not rest or rest[0] not in BENCHES:
            print(f"usage: wmrl bench {{{'|'.join(BENCHES)}}} [key=value ...]", file=sys.stderr)
            return 2
        module_name, rest = f"bench_{rest[0]}", rest[1:]
    try:
        module = importlib.import_module(f"wmrl.run.{module_name}")
    except ModuleNotFoundError as e:
        if e.name == f"wmrl.run.{module_name}":
            print(f"wmrl: subcommand {name!r} is not implemented yet in this version.", file=sys.stderr)
            return 2
        raise
    sys.argv = [f"wmrl {name}"] + rest
    module.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
