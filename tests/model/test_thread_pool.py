"""Which thread starts a CPU thread team (GNU OpenMP: one team per thread that runs parallel torch work).

`clef serve` and Ray replicas run the model on a worker thread; a team started on another live thread as
well made every forward pass slower (model/kernels.py: configure_cpu_threads), so the setup must be able
to leave the calling thread without a team and start one on the worker. Checked by counting the process's
OS threads in a fresh interpreter: a team of two adds one worker thread.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, os, threading, time
from clef_runtime.model.kernels import configure_cpu_threads, start_thread_pool

def os_threads():
    return len(os.listdir("/proc/self/task"))

counts = {"start": os_threads()}
configure_cpu_threads(2, start_pool=False)
counts["configured without a team"] = os_threads()

def worker():
    start_thread_pool()
    counts["worker team"] = os_threads() - 1  # less the worker itself
    start_thread_pool()
    counts["worker team again"] = os_threads() - 1

thread = threading.Thread(target=worker)
thread.start()
thread.join()
# join() returns when the Python thread is done; the OS threads (it and its team) finish exiting just
# after, so wait for them (bounded) instead of counting at once.
deadline = time.monotonic() + 30
while os_threads() > counts["configured without a team"] and time.monotonic() < deadline:
    time.sleep(0.05)
counts["after the worker ended"] = os_threads()
start_thread_pool()
counts["main team"] = os_threads()
print(json.dumps(counts))
"""


def test_teams_start_only_where_asked_and_go_with_their_thread() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    # Thread setup itself may start a helper thread of torch's; teams are counted from there.
    base = counts["configured without a team"]
    assert counts["worker team"] == base + 1  # the worker's team: one OpenMP worker beside it
    assert counts["worker team again"] == base + 1  # idempotent
    assert counts["after the worker ended"] == base  # the team went with its thread
    assert counts["main team"] == base + 1  # the main thread had none: configure left it without
