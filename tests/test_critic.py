"""Progress-value critic: outputs, text conditioning, training on successes and failures."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from wmrl.kernel.types import Obs
from worldmodels.critic import MiniLMEncoder, ProgressValueCritic
from worldmodels.data import EpisodeFrames, heldout_episodes
from worldmodels.evaluate import critic_auroc
from worldmodels.synthetic import make_episodes
from worldmodels.train import train_critic

TINY = OmegaConf.to_container(OmegaConf.load("configs/critic/tiny.yaml"))


def _obs(b=3, size=32):
    g = torch.Generator().manual_seed(0)
    img = {c: torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=g)
           for c in ("agentview", "robot0_eye_in_hand")}
    return Obs(img, torch.randn(b, 9, generator=g), ["lift the red block"] * b)


def test_outputs_in_unit_interval_and_errors():
    c = instantiate(TINY, _convert_="all").eval()
    with pytest.raises(RuntimeError, match="set_norm_stats"):
        c.progress(_obs())
    c.set_norm_stats(torch.zeros(5, 9))                 # zero variance everywhere: still finite
    p, s = c.evaluate(_obs())
    assert p.shape == s.shape == (3,) and p.dtype == torch.float32
    assert ((p >= 0) & (p <= 1)).all() and ((s >= 0) & (s <= 1)).all()
    assert torch.allclose(p, c.progress(_obs())) and torch.allclose(s, c.success_prob(_obs()))
    with pytest.raises(ValueError, match="expects"):
        c.progress(_obs(size=16))
    with pytest.raises(ValueError, match="text_encoder"):
        ProgressValueCritic(text_encoder="bert")


def test_minilm_instruction_embeddings_are_offline_and_distinct():
    enc = MiniLMEncoder()
    e = enc(["lift the red cube", "lift the red cube", "push the red cube to the target"])
    assert e.shape == (3, 384)
    assert torch.allclose(e.norm(dim=1), torch.ones(3), atol=1e-4)
    assert torch.allclose(e[0], e[1]) and float(e[0] @ e[2]) < 0.99


def test_frame_labels_from_time_and_outcome():
    eps = make_episodes(3, length=10, size=32, seed=0)
    eps[0].success, eps[1].success, eps[2].success = True, True, False
    d = EpisodeFrames(eps)
    prog, succ = d.frame_labels(success_tail=3, fail_progress=0.3)
    assert prog[:10].tolist() == pytest.approx(np.linspace(0, 1, 10).tolist())
    assert prog[10:20].tolist() == pytest.approx(np.linspace(0, 1, 10).tolist())
    assert prog[20:30].max() == pytest.approx(0.3)
    assert succ[10:20].tolist() == [0] * 7 + [1] * 3
    assert succ[20:30].sum() == 0


def test_training_separates_success_from_failure(tmp_path):
    eps = make_episodes(20, length=40, size=32, seed=4)
    tr, ho = heldout_episodes(len(eps), 4)
    train, held = EpisodeFrames([eps[i] for i in tr]), EpisodeFrames([eps[i] for i in ho])
    assert 0 < held.success.sum() < held.num_episodes
    torch.manual_seed(0)
    c = instantiate(TINY, _convert_="all")
    rep = train_critic(c, TINY, train, tmp_path, heldout=held, steps=150, batch_size=32, lr=3e-3, warmup=10,
                       success_tail=4, progress=False, resume=False, eval_every=75, checkpoint_every=75)
    assert rep["heldout"]["auroc"] >= 0.8
    assert rep["heldout"]["final_progress_success"] > rep["heldout"]["final_progress_failure"]
    # resumable: continues from the saved step
    rep2 = train_critic(instantiate(TINY, _convert_="all"), TINY, train, tmp_path, steps=160, batch_size=8,
                        progress=False, resume=True, tensorboard=False)
    assert rep2["resumed_from"] == 150 and rep2["steps"] == 160
    from wmrl.kernel.checkpoint import load_checkpoint

    loaded = load_checkpoint(tmp_path / "checkpoints" / "last").eval()
    assert critic_auroc(loaded, held)["auroc"] is not None
