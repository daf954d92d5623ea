"""Filtered BC of gated successes into the flow (issue #21): which chunks are used, the flow learns
them, a steered policy keeps its head, the loop runs the hook on its every."""

import pytest
import torch
from grpo_fakes import GaussianChunkPolicy, toy_grpo_setup
from test_policy import obs, stats, tiny_policy

from policies.steering import LatentNoisePolicy, LatentNoiseSampler
from wmrl import rl as grpo
from wmrl.kernel.types import Obs, PolicySample, Rollout
from wmrl.rl.distill import Distiller, gated_success_chunks


def _rollout(success, alive, group_ids, offset=0.0):
    """A rollout whose chunk (slot b, chunk n) has actions filled with 100 * b + n + offset."""
    B, N = alive.shape
    o = obs(b=B)
    samples = [PolicySample(torch.full((B, 4, 7), 0.0) + (100 * torch.arange(B) + n + offset).view(B, 1, 1),
                            torch.zeros(B)) for n in range(N)]
    return Rollout([o] * N, samples, torch.zeros(B, N), alive, torch.tensor(success), torch.tensor(group_ids))


def test_only_alive_chunks_of_gated_successes_of_real_slots_are_used():
    alive = torch.tensor([[True, True, False], [True, True, True], [True, False, False], [True, True, True]])
    ro = _rollout([True, False, True, True], alive, [0, 0, 1, -1])  # slot 3 is padding
    o, a = gated_success_chunks([ro])
    assert sorted(a[:, 0, 0].tolist()) == [0.0, 1.0, 200.0]  # slot 0's two alive chunks, slot 2's one
    assert isinstance(o, Obs) and o.batch_size == 3
    gate = lambda r: torch.tensor([False, True, True, True])  # noqa: E731 - the uncertainty gate refuses slot 0
    _, a = gated_success_chunks([ro], gate)
    assert a[:, 0, 0].tolist() == [200.0]
    assert gated_success_chunks([ro], lambda r: torch.zeros(4, dtype=torch.bool)) is None
    with pytest.raises(ValueError, match="flags"):
        gated_success_chunks([ro], lambda r: torch.ones(2, dtype=torch.bool))


def _flow():
    torch.manual_seed(0)
    return tiny_policy().set_norm_stats(stats()).eval()


def test_the_flow_learns_the_successes_and_a_steered_policy_keeps_its_head():
    flow = _flow()
    p = LatentNoisePolicy(flow, hidden=16, sampler=LatentNoiseSampler(0.5, 4))
    target = torch.full((2, 4, 7), 0.4)
    B, N = 2, 2
    o = obs(b=B)
    ro = Rollout([o] * N, [PolicySample(target.clone(), torch.zeros(B))] * N, torch.zeros(B, N),
                 torch.ones(B, N, dtype=torch.bool), torch.tensor([True, True]), torch.tensor([0, 0]))
    head = [q.detach().clone() for q in p.noise_head.parameters()]
    base0 = [q.detach().clone() for q in flow.parameters()]
    st = Distiller(steps=60, batch_size=4, lr=3e-3)(p, [ro], torch.Generator().manual_seed(0))
    assert st["distill_chunks"] == 4 and st["distill_loss_last"] < 0.5 * st["distill_loss_first"]
    assert all(torch.equal(a, b) for a, b in zip(head, p.noise_head.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(base0, flow.parameters()))
    assert not any(q.requires_grad for q in flow.parameters())  # frozen again for GRPO
    assert not flow.training
    none = Distiller(steps=5)(p, [_rollout([False, False], torch.ones(2, 2, dtype=torch.bool), [0, 0])])
    assert none == {"distill_chunks": 0.0}
    with pytest.raises(ValueError, match="BC loss"):
        Distiller(steps=1)(GaussianChunkPolicy(), [ro])


def test_the_loop_runs_the_distill_hook_on_its_every(tmp_path):
    _, setup = toy_grpo_setup()
    calls = []

    def distill(policy, rollouts, generator):
        calls.append(len(rollouts))
        return {"distill_chunks": float(sum(int(r.success.sum()) for r in rollouts))}

    out = grpo.train_grpo(setup, grpo.LoopConfig(4, tmp_path, seed=0, progress=False),
                          grpo.GRPOHooks(distill=grpo.DistillHook(distill, every=2)))
    assert len(calls) == 2 and all(n > 0 for n in calls)
    assert ["distill_chunks" in h for h in out["history"]] == [False, True, False, True]
