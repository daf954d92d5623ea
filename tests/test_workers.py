"""Worker processes die with their parent (wmrl.kernel.workers), even when it is killed with SIGKILL:
Ray's task workers of a local cluster go with the driver that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PARENT = """
import os, sys, time
from wmrl.kernel.workers import worker_pool

def hold(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(120)

pool = worker_pool(2)
futs = [pool.submit(hold, f"{sys.argv[1]}/w{k}") for k in range(2)]
while sum(os.path.exists(f"{sys.argv[1]}/w{k}") for k in range(2)) < 2:
    time.sleep(0.1)
time.sleep(0.5)
print(" ".join(open(f"{sys.argv[1]}/w{k}").read() for k in range(2)), flush=True)
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


def test_workers_die_within_seconds_of_a_killed_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        t0 = time.time()
        while any(_alive(p) for p in pids) and time.time() - t0 < 10:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a worker outlived its killed parent by 10 s"
    finally:
        parent.kill()
        for p in locals().get("pids", []):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        from wmrl.kernel.workers import reap_stale_local_clusters

        reap_stale_local_clusters()      # the killed driver's idle Ray agents
