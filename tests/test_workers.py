"""Worker processes die with their parent (wmrl.kernel.workers), even when it is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PARENT = """
import sys, time
from wmrl.kernel.workers import worker_pool
pool = worker_pool(2)
futs = [pool.submit(time.sleep, 120) for _ in range(2)]
while len(pool._processes) < 2:
    time.sleep(0.05)
time.sleep(1.0)                     # the workers are running their task
print(" ".join(str(p) for p in pool._processes), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                            # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_die_within_seconds_of_a_killed_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        t0 = time.time()
        while any(_alive(p) for p in pids) and time.time() - t0 < 5:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a worker outlived its killed parent by 5 s"
    finally:
        parent.kill()
        for p in locals().get("pids", []):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
