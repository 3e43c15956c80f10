"""`LauncherWatch` on its own: a process whose parent is SIGKILLed notices, starts its shutdown,
and is ended after its grace even though its main thread never returns. The whole runs (server
and `LLM` under torchrun) are in `test_launcher_faults.py`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from shm_ipc.liveness import ParentWatch, ProcessWatch
from tests.server_harness import REPO_ROOT, wait_until

# Runs as the grandchild of the test: its parent (the "launcher") is the process the test kills.
CHILD = """
    import sys, time
    from rank_worker.dist.launcher_watch import LauncherWatch
    from shm_ipc.liveness import ParentWatch

    def on_gone(message):
        print("GONE:", message, flush=True)

    LauncherWatch(ParentWatch(), "the launcher", on_gone, grace_s=0.3, exit_code=7).start()
    print("WATCHING", flush=True)
    time.sleep(60)  # a main thread that never notices anything itself
"""

# The "launcher": starts the child with its output in a file, prints its pid, waits forever.
LAUNCHER = """
    import subprocess, sys, time
    out = open(sys.argv[2], "wb")
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=out, stderr=out)
    print(child.pid, flush=True)
    time.sleep(60)
"""


def test_parent_watch_sees_its_parent():
    watch = ParentWatch()
    assert watch.pid == os.getppid() and watch.alive()


def test_a_process_whose_launcher_is_killed_ends_after_its_grace(tmp_path):
    out = tmp_path / "child.out"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LAUNCHER), textwrap.dedent(CHILD), str(out)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
    )
    child = ProcessWatch(int(launcher.stdout.readline()))
    try:
        wait_until(lambda: b"WATCHING" in out.read_bytes(), 60, "the child to start watching")
        t0 = time.monotonic()
        launcher.kill()
        launcher.wait()
        wait_until(lambda: not child.alive(), 5, "the child to exit")
        gone_s = time.monotonic() - t0
        text = out.read_text()
        assert f"GONE: the launcher (pid {launcher.pid}) is gone" in text, text
        assert "not shut down after 0.3 s, exiting now" in text, text
        # Noticed within a poll or two, then the 0.3 s grace.
        assert gone_s < 2.0, gone_s
    finally:
        launcher.stdout.close()
        if child.alive():
            os.kill(child.pid, signal.SIGKILL)
