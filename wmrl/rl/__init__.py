"""The RL engine (imports only ``wmrl.kernel``), split by capability:

* :mod:`wmrl.rl.losses`: group advantages, the clipped surrogate, the KL to a reference;
* :mod:`wmrl.rl.rollout`: the one batched rollout engine with a step recorder (GRPO groups,
  open-loop replays, whole recorded episodes) and the one slot padding;
* :mod:`wmrl.rl.starts`: start providers (init states, keyframes, real-frame context, mixtures);
* :mod:`wmrl.rl.evaluate`: the Wilson interval, the success summary, the chunk-env evaluator;
* :mod:`wmrl.rl.debias`: the world-model reward mitigations (online debiasing, inverse-variance
  denoising);
* :mod:`wmrl.rl.update`: ``GRPOConfig``, the transitions of the loss and the PPO-style update;
* :mod:`wmrl.rl.loop`: one GRPO iteration and the training loop (``LoopConfig`` + ``GRPOHooks``).

The names below are re-exported for ``from wmrl import rl``.
"""

from wmrl.rl.debias import OnlineDebiaser, inverse_variance_rewards, real_rollout_fn_for
from wmrl.rl.evaluate import evaluate_success, success_summary, wilson_interval
from wmrl.rl.loop import (
    CheckpointHook,
    DebiasHook,
    DenoiseHook,
    DistillHook,
    EvalHook,
    GRPOHooks,
    GRPOSetup,
    IterationResult,
    LoopConfig,
    RefreshHook,
    grpo_iteration,
    train_grpo,
)
from wmrl.rl.losses import (
    clipped_surrogate_loss,
    describe,
    group_advantages,
    kl_to_reference,
    masked_mean,
)
from wmrl.rl.rollout import (
    cat_samples,
    collect_groups,
    expand_starts,
    pad_slots,
    record_episodes,
    replay_open_loop,
    rollout_batch,
    rollout_returns,
)
from wmrl.rl.starts import (
    ContextStarts,
    InitStateStarts,
    KeyframeStarts,
    MixedStarts,
    all_starts,
    starts_from_store,
)
from wmrl.rl.distill import Distiller, gated_success_chunks
from wmrl.rl.value import ValueBaseline, chunk_rewards, gae
from wmrl.rl.update import (
    GRPOConfig,
    TransitionBatch,
    build_transitions,
    check_policy,
    grpo_update,
    make_reference,
)

__all__ = [
    "CheckpointHook", "ContextStarts", "DebiasHook", "DenoiseHook", "DistillHook", "Distiller", "EvalHook", "GRPOConfig", "GRPOHooks", "GRPOSetup",
    "InitStateStarts", "IterationResult", "KeyframeStarts", "LoopConfig", "MixedStarts", "OnlineDebiaser",
    "RefreshHook", "TransitionBatch", "all_starts", "build_transitions", "cat_samples", "check_policy",
    "clipped_surrogate_loss", "collect_groups", "describe", "evaluate_success", "expand_starts", "gated_success_chunks", "group_advantages",
    "grpo_iteration", "grpo_update", "inverse_variance_rewards", "kl_to_reference", "make_reference", "masked_mean",
    "pad_slots", "real_rollout_fn_for", "record_episodes", "replay_open_loop", "rollout_batch", "rollout_returns",
    "starts_from_store", "success_summary", "train_grpo", "wilson_interval", "ValueBaseline", "chunk_rewards", "gae",
]
