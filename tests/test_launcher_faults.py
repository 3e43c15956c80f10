"""A launcher killed with SIGKILL takes its whole run down (`rank_worker.dist.launcher_watch`).

torchrun starts every rank in a session of its own, so nothing signals the ranks when its agent
is killed outright (the OOM killer, `kill -9`, a scheduler reclaiming the node). Each test starts
the real thing on CPU (gloo, demo model), records every process below the launcher from /proc,
SIGKILLs exactly the launcher and asserts that every one of those processes is gone within
`EXIT_BOUND_S`, and that no /dev/shm segment, socket file or run directory of the run is left:

- the server under torchrun (2 ranks), a stream in flight: the stream ends with an error naming
  the launcher, rank 0 logs why it ended, and the port is free again; also with rank 0 stuck in
  a collective (rank 1 stalls at step 3), which only the watch's second stage can end;
- `LLM` under torchrun (2 ranks), the script inside `generate` (which raises `EngineDeadError`
  naming the launcher) or idle in its own code (rank 0 ends itself after its grace).

The plain-Python launch (`python launch/serve.py --tensor-parallel-size N`, whose first process
is rank 0) is `test_faults_server.py::test_sigkilled_rank0_takes_every_worker_and_the_api_process_down`.

Each test prints a `FAULT-FIGURE` line (seconds from the SIGKILL until every process was gone)
for the fault table of docs/faults.md; run with `-s -n 0` to see them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from shm_ipc.liveness import ProcessWatch
from tests.server_harness import (
    REPO_ROOT,
    Server,
    descendants,
    parse_sse,
    port_is_free,
    shm_entries,
    torchrun_cmd,
    wait_until,
)

pytestmark = pytest.mark.slow

# The bound: every process of the run gone within this after the launcher's SIGKILL.
EXIT_BOUND_S = 10.0


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("TP_ENGINE_CACHE")
    os.environ["TP_ENGINE_CACHE"] = str(cache)
    try:
        from tp_engine.demo import demo_checkpoint_dir

        demo_checkpoint_dir()  # built once here; every run finds it
    finally:
        if old is None:
            del os.environ["TP_ENGINE_CACHE"]
        else:
            os.environ["TP_ENGINE_CACHE"] = old
    return cache


@pytest.fixture
def run_env(cache):
    """The environment of one run, with a short TMPDIR of its own (socket paths must stay
    short) in which every name the run makes is created."""
    tmpdir = Path(tempfile.mkdtemp(prefix="tplaunch-"))
    env = dict(os.environ, TP_ENGINE_CACHE=str(cache), TMPDIR=str(tmpdir))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    for name in ("XDG_RUNTIME_DIR", "TP_ENGINE_FAULT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    yield env, tmpdir
    shutil.rmtree(tmpdir, ignore_errors=True)


def kill_launcher(launcher_pid: int, watches: list[ProcessWatch]) -> float:
    """SIGKILL the launcher; seconds until every watched process is gone (fails past the
    bound, naming the survivors)."""
    t0 = time.monotonic()
    os.kill(launcher_pid, signal.SIGKILL)
    deadline = t0 + EXIT_BOUND_S
    while time.monotonic() < deadline:
        if not any(w.alive() for w in watches):
            return time.monotonic() - t0
        time.sleep(0.02)
    alive = [w.pid for w in watches if w.alive()]
    raise AssertionError(f"still running {EXIT_BOUND_S} s after the launcher's SIGKILL: {alive}")


def check_nothing_left(tmpdir: Path, watches: list[ProcessWatch]) -> None:
    # A segment's name starts with its creator's pid (`shm_ipc.handle.RunNames`): only the
    # run's own count, so that another test run on the machine cannot fail this check.
    prefixes = tuple(f"tpe-{w.pid}-" for w in watches)
    leaked = {name for name in shm_entries() if name.startswith(prefixes)}
    assert not leaked, f"/dev/shm left behind: {leaked}"
    # torchrun's own log directory (torchelastic_*) is the dead agent's, which never removes
    # it even on a clean exit; only the run's names (tpe-*) are ours.
    left = [p.name for p in tmpdir.iterdir() if p.name.startswith("tpe-")]
    assert not left, f"left in TMPDIR: {left}"


def kill_all(watches: list[ProcessWatch]) -> None:
    """Teardown of a failed test: nothing of the run may outlive it."""
    for w in watches:
        if w.alive():
            os.kill(w.pid, signal.SIGKILL)


def figure(**fields) -> None:
    print("FAULT-FIGURE " + json.dumps(fields), flush=True)


@pytest.mark.parametrize("rank0", ["serving", "stuck"])
def test_sigkilled_torchrun_agent_ends_the_server(run_env, tmp_path, rank0):
    env, tmpdir = run_env
    if rank0 == "stuck":
        # Rank 1 sleeps before step 3's forward, so rank 0 waits in a collective for good
        # (the engine watchdog's default 120 s is far off).
        env["TP_ENGINE_FAULT"] = "rank=1,step=3,kind=stall"
    # Room for a stream far longer than the test (the demo model is tiny).
    args = ["--port", "0", "--num-kv-blocks", "300", "--max-model-len", "4096"]
    server = Server([*torchrun_cmd(2), *args], env, tmp_path / "server.log").wait_ready()
    try:
        watches = server.watches  # rank 0, rank 1 and the API process
        assert len(watches) >= 3, [w.pid for w in watches]
        conn = server.connection(timeout_s=60)
        body = {"prompt": "Tell me a story", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}  # fmt: skip
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # the stream is under way
        assert resp.readline() == b"\n"
        if rank0 == "stuck":
            time.sleep(1.0)  # a few steps on: rank 0 is blocked in step 3 by now

        gone_s = kill_launcher(server.proc.pid, watches)
        server.proc.wait(timeout=5)

        # The client's stream ends with an error naming why, not a hang or a cut connection.
        events = parse_sse(resp.read())
        conn.close()
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["code"] == "engine_dead" and "the launcher" in error["message"], error
        log = server.log()
        why = f"the launcher (pid {server.proc.pid}) is gone"
        if rank0 == "serving":  # the engine loop ended the run
            assert f"engine dead: {why}" in log, log[-3000:]
        else:  # the loop never came back from its step: the watch ended the process
            assert f"{why}; not shut down after" in log, log[-3000:]
        assert port_is_free(server.host, server.port)
        check_nothing_left(tmpdir, watches)
        figure(injected="sigkill torchrun agent", launch=f"torchrun serve (rank 0 {rank0})", ranks=2,
               all_gone_s=round(gone_s, 2))  # fmt: skip
    finally:
        server.stop()


LLM_SCRIPT = """
    import sys
    import time

    from tp_engine import LLM, SamplingParams

    llm = LLM(num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(["Hello"], params, use_tqdm=False)
    print("READY", flush=True)
    if sys.argv[1] == "idle":
        time.sleep(600)  # in the script's own code, never calling the engine again
    while True:
        llm.generate(["Tell me a story"] * 4, params, use_tqdm=False)
"""


@pytest.mark.parametrize("doing", ["generate", "idle"])
def test_sigkilled_torchrun_agent_ends_an_llm_script(run_env, tmp_path, doing):
    env, tmpdir = run_env
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(LLM_SCRIPT))
    log_path = tmp_path / "script.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script), doing]  # fmt: skip
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    watches: list[ProcessWatch] = []
    try:
        wait_until(
            lambda: b"READY" in log_path.read_bytes() or agent.poll() is not None,
            180,
            "the script to start",
        )
        assert agent.poll() is None, log_path.read_text()[-3000:]
        watches = [ProcessWatch(pid) for pid in descendants(agent.pid)]
        assert len(watches) == 2, [w.pid for w in watches]

        gone_s = kill_launcher(agent.pid, watches)
        agent.wait(timeout=5)

        log = log_path.read_text(errors="replace")
        why = f"the launcher (pid {agent.pid}) is gone"
        if doing == "generate":  # rank 0's generate raised, and the script ended with it
            assert f"EngineDeadError: {why}" in log, log[-3000:]
        else:  # rank 0 was not in the engine: its watch ended it after the grace
            assert f"{why}; not shut down after" in log, log[-3000:]
        check_nothing_left(tmpdir, watches)
        figure(injected="sigkill torchrun agent", launch=f"torchrun LLM ({doing})", ranks=2,
               all_gone_s=round(gone_s, 2))  # fmt: skip
    finally:
        kill_all(watches)
        if agent.poll() is None:
            agent.kill()
        agent.wait(timeout=30)
