"""Small fake ChunkEnv and Gaussian chunk policy for the GRPO / post-train / pipeline tests.

``ToyReachEnv``: each slot moves a point in ``R^D_a`` (first 3 dims) toward a per-task goal; chunk
semantics follow the ChunkEnv contract (an inner success ends the chunk there, the reward of the
executed steps is kept, only finished slots auto-reset and carry ``terminated|truncated``).
``GaussianChunkPolicy``: a linear-Gaussian chunking policy with an exact differentiable log-prob.
"""

from __future__ import annotations

import math

import torch

from wmrl.kernel.types import Obs, PolicySample, Start, StepResult

GOALS = {"reach_a": (0.5, 0.0, 0.0), "reach_b": (0.0, 0.5, 0.0), "reach_c": (-0.5, 0.0, 0.0)}


class ToyReachEnv:
    def __init__(self, num_envs: int, chunk_size: int = 4, action_dim: int = 3, max_steps: int = 24,
                 reward_bias: float = 0.0, reward_noise: float = 0.0, seed: int = 0, tol: float = 0.15):
        self.num_envs, self.action_dim, self.chunk_size = num_envs, action_dim, chunk_size
        self.max_steps, self.reward_bias, self.reward_noise, self.tol = max_steps, reward_bias, reward_noise, tol
        self.gen = torch.Generator().manual_seed(seed)
        self.pos = torch.zeros(num_envs, 3)
        self.goal = torch.zeros(num_envs, 3)
        self.t = torch.zeros(num_envs, dtype=torch.long)
        self.starts: list[Start] = []
        self.resets = 0

    @staticmethod
    def init_pos(index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + int(index or 0))
        return (torch.rand(3, generator=g) - 0.5) * 0.4

    def _reset_slot(self, i: int) -> None:
        s = self.starts[i]
        self.pos[i] = self.init_pos(s.init_index)
        self.goal[i] = torch.tensor(GOALS[s.task_name])
        self.t[i] = 0

    def _obs(self) -> Obs:
        img = (self.pos[:, :3, None, None].clamp(-1, 1) * 100 + 128).to(torch.uint8).expand(-1, 3, 4, 4).contiguous()
        prop = torch.cat([self.pos, self.goal], 1)
        return Obs({"agentview": img}, prop.float(), [s.instruction for s in self.starts])

    def reset(self, starts):
        if len(starts) != self.num_envs:
            raise ValueError("len(starts) != num_envs")
        self.starts = list(starts)
        self.resets += 1
        for i in range(self.num_envs):
            self._reset_slot(i)
        return self._obs()

    def reset_slots(self, slots, starts):  # wmrl.kernel.interfaces.ChunkEnv
        if len(slots) != len(starts) or any(not 0 <= int(i) < self.num_envs for i in slots):
            raise ValueError("reset_slots: one start per slot, slots in range")
        for i, s in zip(slots, starts):
            self.starts[int(i)] = s
            self._reset_slot(int(i))
        return self._obs()

    def step(self, actions):
        if actions.shape != (self.num_envs, actions.shape[1], self.action_dim):
            raise ValueError(f"bad actions shape {tuple(actions.shape)}")
        b = self.num_envs
        reward = torch.zeros(b); term = torch.zeros(b, dtype=torch.bool); trunc = torch.zeros(b, dtype=torch.bool)
        succ = torch.zeros(b, dtype=torch.bool); steps = torch.zeros(b, dtype=torch.long)
        for i in range(b):
            for h in range(actions.shape[1]):
                d0 = float((self.pos[i] - self.goal[i]).norm())
                self.pos[i] += 0.1 * actions[i, h, :3].clamp(-1, 1)
                self.t[i] += 1
                steps[i] += 1
                d1 = float((self.pos[i] - self.goal[i]).norm())
                reward[i] += d0 - d1
                if d1 < self.tol:
                    term[i] = succ[i] = True
                    reward[i] += 1.0
                    break
                if self.t[i] >= self.max_steps:
                    trunc[i] = True
                    break
        reward = reward + self.reward_bias
        if self.reward_noise:
            reward = reward + self.reward_noise * torch.randn(b, generator=self.gen)
        final = self._obs()
        for i in range(b):
            if term[i] or trunc[i]:
                self._reset_slot(i)
        return StepResult(self._obs(), reward, term, trunc, succ, steps, {"final_obs": final})


class NoisyToyEnv(ToyReachEnv):
    """Reward noise from a generator the env owns, declared as ``wmrl.kernel.interfaces.RandomStreams``."""

    def rng_streams(self):
        return {"reward_noise": self.gen}


class GaussianChunkPolicy(torch.nn.Module):
    supports_rtc = False  # wmrl.kernel.interfaces.Policy

    def __init__(self, chunk_size: int = 4, action_dim: int = 3, obs_dim: int = 6, init_std: float = 0.6, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.chunk_size, self.action_dim = chunk_size, action_dim
        self.feature_dim = obs_dim  # what encode() gives a value baseline
        self.net = torch.nn.Linear(obs_dim, chunk_size * action_dim)
        torch.nn.init.zeros_(self.net.weight); torch.nn.init.zeros_(self.net.bias)
        self.log_std = torch.nn.Parameter(torch.full((action_dim,), math.log(init_std)))

    def _mean(self, obs: Obs) -> torch.Tensor:
        return self.net(obs.proprio).view(-1, self.chunk_size, self.action_dim)

    def encode(self, images, proprio: torch.Tensor, tasks) -> torch.Tensor:
        """The features a value baseline reads (``wmrl.rl.value``): the toy state itself."""
        return proprio.float()

    def sample(self, obs: Obs, generator=None) -> PolicySample:
        mean = self._mean(obs)
        eps = torch.randn(mean.shape, generator=generator)
        actions = mean + self.log_std.exp() * eps
        s = PolicySample(actions, torch.zeros(mean.shape[0]), {"noise": eps})
        s.log_prob = self.log_prob(obs, s)
        return s

    def log_prob(self, obs: Obs, sample: PolicySample, per_step: bool = False) -> torch.Tensor:
        mean = self._mean(obs)
        dist = torch.distributions.Normal(mean, self.log_std.exp())
        lp = dist.log_prob(sample.actions).sum((1, 2))
        return lp[:, None] if per_step else lp  # one Gaussian "step"


def toy_starts(n_per_task: int, tasks=("reach_a", "reach_b"), offset: int = 0) -> list[Start]:
    return [Start(task_name=t, instruction=f"go {t}", init_index=offset + i, split="train")
            for t in tasks for i in range(n_per_task)]


def toy_grpo_setup(**cfg_kw):
    """The toy GRPO run of the loop tests: a Gaussian chunk policy on ToyReach (8 slots, 12 steps),
    two starts, groups of 4, 3 chunks, Adam at 0.02; ``cfg_kw`` override ``GRPOConfig`` fields.
    Returns ``(policy, GRPOSetup)``."""
    from wmrl import rl as grpo

    torch.manual_seed(0)
    pol = GaussianChunkPolicy()
    env = ToyReachEnv(num_envs=8, max_steps=12)
    opt = torch.optim.Adam(pol.parameters(), lr=0.02)
    cfg = grpo.GRPOConfig(**{"group_size": 4, "max_chunks": 3, "epochs": 1, "minibatch_size": 16, **cfg_kw})
    starts = toy_starts(2)
    return pol, grpo.GRPOSetup(pol, {"chunk_size": 4, "action_dim": 3}, env, opt, lambda it: starts, cfg)
