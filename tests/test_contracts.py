"""Contract tests: every implementation of a shared contract is checked here.

Sections: EpisodeStore (below). Other packages add their protocol implementations
(WorldModel, ProgressCritic, Policy, ChunkEnv, Transport) in their own sections.
"""

from __future__ import annotations

import numpy as np
import torch

# ---------------------------------------------------------------------- EpisodeStore / WindowDataset
from wmrl.storage import EpisodeStore, NormStats, WindowDataset
from wmrl.storage.synthetic import random_episode, random_store
from wmrl.types import AGENTVIEW, EYE_IN_HAND, Episode, Obs


def test_store_contract_episode_container_and_meta(tmp_path):
    cams = {AGENTVIEW: (8, 8), EYE_IN_HAND: (8, 8)}
    s = random_store(tmp_path / "s", lengths=[4, 3], cameras=cams)
    ep = EpisodeStore.open(s.path).episode(0)
    assert isinstance(ep, Episode) and ep.length == 4
    assert ep.images[AGENTVIEW].dtype == np.uint8 and ep.images[AGENTVIEW].shape == (4, 3, 8, 8)
    assert ep.proprio.dtype == np.float32 and ep.proprio.shape == (4, 9)
    assert ep.actions.dtype == np.float32 and ep.actions.shape == (4, 7)
    assert ep.rewards.dtype == np.float32 and ep.rewards.shape == (4,)
    assert set(s.meta) >= {"cameras", "state_dim", "action_dim", "fps", "action_space", "embodiment", "source",
                           "format_version"}
    assert s.lengths.dtype == np.int64 and isinstance(s.stats(), NormStats)


def test_window_batch_converts_to_obs(tmp_path):
    """A WindowDataset batch's last observation is a valid ``Obs`` for a policy / world model."""
    cams = {AGENTVIEW: (8, 8)}
    s = random_store(tmp_path / "s", lengths=[5], cameras=cams)
    b = WindowDataset(s, n_obs=2, horizon=3).get_batch([0, 4])
    obs = Obs(images={c: v[:, -1] for c, v in b["images"].items()}, proprio=b["proprio"][:, -1],
              task=b["instruction"]).validate()
    assert obs.batch_size == 2 and b["actions"].dtype == torch.float32
    assert b["obs_pad"].dtype == torch.bool and b["action_pad"].dtype == torch.bool
    np.testing.assert_array_equal(obs.images[AGENTVIEW][1].numpy(), random_episode(5, cams, seed=0).images[AGENTVIEW][4])
