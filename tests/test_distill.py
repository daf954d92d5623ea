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
    _, a = gated_success_chunks([ro], first_chunks=1)          # the chunk taken on each start's own frame
    assert sorted(a[:, 0, 0].tolist()) == [0.0, 200.0]
    with pytest.raises(ValueError, match="first_chunks"):
        gated_success_chunks([ro], first_chunks=0)
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


def test_the_success_buffer_keeps_the_newest_chunks_of_every_add_and_round_trips():
    from wmrl.rl.distill import SuccessBuffer

    alive = torch.ones(2, 3, dtype=torch.bool)
    buf = SuccessBuffer(capacity=5)
    assert buf.data() is None and len(buf) == 0
    assert buf.add([_rollout([True, False], alive, [0, 0])]) == 3        # slot 0: chunks 0, 1, 2
    assert buf.add([_rollout([False, True], alive, [0, 0], offset=0.5)]) == 3  # slot 1: 100.5, 101.5, 102.5
    assert buf.add([_rollout([False, False], alive, [0, 0])]) == 0
    _, a = buf.data()
    assert len(buf) == 5 and buf.added == 6
    assert a[:, 0, 0].tolist() == [1.0, 2.0, 100.5, 101.5, 102.5]       # the oldest chunk dropped
    t, meta = buf.state_tensors()
    back = SuccessBuffer(capacity=5)
    back.load_state_tensors(t, meta)
    o2, a2 = back.data()
    o1, _ = buf.data()
    assert torch.equal(a2, a) and torch.equal(o2.proprio, o1.proprio) and o2.task == o1.task
    assert all(torch.equal(o2.images[k], o1.images[k]) for k in o1.images) and back.added == 6
    gated = SuccessBuffer(capacity=10, gate=lambda r: torch.tensor([False, True]))
    assert gated.add([_rollout([True, True], alive, [0, 0])]) == 3
    first = SuccessBuffer(capacity=10, first_chunks=2)
    assert first.add([_rollout([True, True], alive, [0, 0])]) == 4       # chunks 0 and 1 of both slots
    assert sorted(first.data()[1][:, 0, 0].tolist()) == [0.0, 1.0, 100.0, 101.0]
    with pytest.raises(ValueError, match="capacity"):
        SuccessBuffer(capacity=0)
    wrong = Rollout([obs(b=2)] * 3, [PolicySample(torch.zeros(2, 4, 5), torch.zeros(2))] * 3, torch.zeros(2, 3),
                    alive, torch.tensor([True, True]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="shaped"):
        buf.add([wrong])
    meta_bad = dict(meta, task=meta["task"][:-1])
    with pytest.raises(ValueError, match="damaged"):
        SuccessBuffer(5).load_state_tensors(t, meta_bad)


def test_the_loop_fills_the_buffer_every_iteration_and_a_resumed_run_distils_the_same_data(tmp_path):
    from wmrl.rl.distill import SuccessBuffer

    def run(out, iterations, seen):
        _, setup = toy_grpo_setup()
        setup.env.tol = 0.45          # some rollouts reach their goal
        buf = SuccessBuffer(capacity=1000)

        def distill(policy, rollouts, generator):
            _, a = buf.data() if buf.data() is not None else (None, torch.zeros(0))
            seen.append(a.clone())
            return {"distill_chunks": float(a.shape[0])}

        return grpo.train_grpo(setup, grpo.LoopConfig(iterations, out, seed=0, progress=False),
                               grpo.GRPOHooks(distill=grpo.DistillHook(distill, every=2, buffer=buf))), buf

    full, stopped, resumed = [], [], []
    out, buf = run(tmp_path / "a", 4, full)
    hist = out["history"]
    assert all("distill_buffer_added" in h for h in hist)
    assert [h["distill_buffer_chunks"] for h in hist] == list(
        torch.cumsum(torch.tensor([h["distill_buffer_added"] for h in hist]), 0).tolist())
    assert sum(h["distill_buffer_added"] for h in hist) > 0 and len(full) == 2
    assert full[-1].shape[0] == len(buf) == hist[-1]["distill_buffer_chunks"]   # every iteration's successes, not the last one's
    run(tmp_path / "b", 3, stopped)
    out_b, _ = run(tmp_path / "b", 4, resumed)        # resumes after iteration 3, distils at 4
    assert len(resumed) == 1 and torch.equal(resumed[0], full[-1])
    assert out_b["history"][-1]["distill_buffer_chunks"] == hist[-1]["distill_buffer_chunks"]


def test_balanced_draws_give_a_rare_task_as_many_chunks_as_a_common_one():
    tasks = ["lift"] * 90 + ["stack"] * 10
    g = torch.Generator().manual_seed(0)
    d_u, d_b = Distiller(batch_size=4000), Distiller(batch_size=4000, balance_tasks=True)
    assert d_u.task_weights(tasks) is None
    uniform = d_u.draw(100, d_u.task_weights(tasks), g)
    balanced = d_b.draw(100, d_b.task_weights(tasks), g)
    assert uniform.min() >= 0 and uniform.max() < 100 and balanced.min() >= 0 and balanced.max() < 100
    assert abs(float((uniform >= 90).float().mean()) - 0.1) < 0.03     # stack: its share of the chunks
    assert abs(float((balanced >= 90).float().mean()) - 0.5) < 0.03    # stack: half the batch
    assert len(set(balanced[balanced >= 90].tolist())) == 10           # still every stack chunk
    d1 = Distiller(batch_size=8, balance_tasks=True)
    one = d1.draw(5, d1.task_weights(["lift"] * 5), g)
    assert one.shape == (8,) and one.max() < 5
