"""Storage speed figures: ``python -m wmrl.kernel.storage.bench [--steps 500] [--size 64] [--episodes 5]``.

Prints the time to append an episode with two cameras (durable and not), to read it back, to load
a :class:`WindowDataset` in memory, and the window throughput of ``get_batch`` / ``__getitem__``.
Writes into a temporary folder that is removed afterwards.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def main(argv: list[str] | None = None) -> dict:
    from wmrl.kernel.storage import EpisodeStore, WindowDataset
    from wmrl.kernel.storage.synthetic import random_episode
    from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND, PANDA_OSC_POSE

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cams = {AGENTVIEW: (args.size, args.size), EYE_IN_HAND: (args.size, args.size)}
    ep = random_episode(args.steps, cams, seed=0)
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for durable in (True, False):
            s = EpisodeStore.create(Path(d) / f"s{durable}", cameras=cams, state_dim=9, action_dim=7, fps=20,
                                    action_space=PANDA_OSC_POSE, durable=durable)
            ts = []
            for _ in range(args.episodes):
                t0 = time.perf_counter()
                s.append(ep)
                ts.append(time.perf_counter() - t0)
            out[f"append_s_median{'_durable' if durable else ''}"] = float(np.median(ts))
        t0 = time.perf_counter()
        s.episode(0)
        out["read_episode_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ds = WindowDataset(s, n_obs=2, horizon=16)
        out["load_in_memory_s"] = time.perf_counter() - t0
        g = torch.Generator().manual_seed(0)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 1.0:
            ds.sample_batch(args.batch, generator=g)
            n += args.batch
        out["windows_per_s_get_batch"] = n / (time.perf_counter() - t0)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 1.0:
            ds[n % len(ds)]
            n += 1
        out["windows_per_s_getitem"] = n / (time.perf_counter() - t0)
    print(f"{args.steps}-step episodes, 2 cameras {args.size}x{args.size}, batch {args.batch}:")
    for k, v in out.items():
        print(f"  {k:28s} {v:.4g}")
    return out


if __name__ == "__main__":
    main()
