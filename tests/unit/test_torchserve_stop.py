"""Stopping an instance does not wait for its killed processes to be reaped
(serving.torchserve._running_after): a process that exited is gone, its ports and files
closed, though its parent (PID 1, for a killed worker) has not reaped it yet
(docs/performance.md §Persistent tier numbers)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from serving.torchserve import _running_after

# A parent that never reaps its child: the child stays a zombie while the parent lives, as a
# killed worker stays one until PID 1 reaps it.
NEGLECTFUL_PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_an_exited_but_unreaped_process_counts_as_gone_at_once():
    parent = subprocess.Popen([sys.executable, "-c", NEGLECTFUL_PARENT], stdout=subprocess.PIPE)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 10
        while child.status() != psutil.STATUS_ZOMBIE:  # bounded poll: it exits at once
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        start = time.monotonic()
        assert _running_after([child], timeout=5) == []
        assert time.monotonic() - start < 1  # psutil.wait_procs would wait the 5 s
        running = psutil.Process(parent.pid)
        assert _running_after([running], timeout=0.2) == [running]  # a live one is running
    finally:
        parent.kill()
        parent.wait(timeout=10)
