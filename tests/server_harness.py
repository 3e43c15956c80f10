"""Start the real server (`launch/serve.py`, under torchrun or plain Python) and talk HTTP to it.

Standard library only (`http.client`), so the HTTP tests need no client package. The server
writes its log to a file (never a pipe that could fill up); a failure shows the log's tail.
Every process the server starts is recorded while it runs, so a test can check that none
outlives it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from shm_ipc.liveness import ProcessWatch

REPO_ROOT = Path(__file__).resolve().parents[1]
_SERVING = re.compile(r"serving .* on http://([\w.\-\[\]:]+):(\d+)")


def serving(model_dir: Path, log_path: Path, *args: str) -> Iterator[Server]:
    """The body of a module fixture (`yield from serving(...)`): `launch/serve.py --model
    model_dir --port 0 ARGS` without an injected fault, stopped at the end, whose log must then
    hold no traceback."""
    env = dict(os.environ)
    env.pop("TP_ENGINE_FAULT", None)
    cmd = [sys.executable, "launch/serve.py", "--model", str(model_dir), "--port", "0", *args]
    srv = Server(cmd, env, log_path).wait_ready()
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log(), srv.log_tail()


def torchrun_cmd(nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "launch/serve.py",
    ]


class Server:
    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        log_path: Path,
        ready_pattern: re.Pattern[str] = _SERVING,
    ) -> None:
        """`ready_pattern`: the log line that announces the serving host and port (groups 1
        and 2)."""
        self.log_path = log_path
        self._ready = ready_pattern
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.host = "127.0.0.1"
        self.port = 0
        # Every process below the launcher once it served, watched by pid and start time (a
        # reused pid is never mistaken for ours).
        self.watches: list[ProcessWatch] = []

    # -- life --------------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            match = self._ready.search(self.log())
            if match:
                self.port = int(match.group(2))
                if self.get("/health")[0] == 200:
                    self.watches = [ProcessWatch(pid) for pid in self.descendants()]
                    return self
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 6000) -> str:
        return self.log()[-n:]

    def run_pids(self) -> set[int]:
        """The launcher and every process below it once it served: the processes whose /dev/shm
        segments (`shm_entries(pids)`) are this run's."""
        return {self.proc.pid} | {w.pid for w in self.watches}

    def descendants(self) -> set[int]:
        """Pids of every process below the launcher (the API process included)."""
        return descendants(self.proc.pid)

    def rank0_pid(self) -> int:
        """Rank 0's process: the launcher itself, or torchrun's child with RANK=0."""
        for pid in sorted(self.descendants() | {self.proc.pid}):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"launch/serve.py" not in cmdline or b"torch.distributed.run" in cmdline:
                continue
            if b"RANK=0" in environ or not any(e.startswith(b"RANK=") for e in environ):
                return pid
        raise AssertionError("no rank 0 process found")

    def alive_pids(self) -> set[int]:
        """The launcher and the processes below it that are still running."""
        watches = (
            [*self.watches, ProcessWatch(self.proc.pid)]
            if self.proc.poll() is None
            else self.watches
        )
        return {w.pid for w in watches if w.alive()}

    def stop(self) -> None:
        """Teardown: whatever of ours still runs is killed."""
        for pid in self.descendants() | self.alive_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()

    # -- HTTP ------------------------------------------------------------------------------------

    def connection(self, timeout_s: float = 120.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        conn = self.connection()
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        try:
            return self.request("GET", path, headers=headers)
        except OSError:
            return 0, b""

    def post(
        self, path: str, obj: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        status, data = self.request("POST", path, body, all_headers)
        return status, json.loads(data)

    def stream(
        self, path: str, obj: dict[str, Any], headers: dict[str, str] | None = None
    ) -> list[Any]:
        """The SSE events of a streamed response: parsed JSON objects, then "[DONE]"."""
        status, data = self.request(
            "POST",
            path,
            json.dumps(obj).encode(),
            {"Content-Type": "application/json", **(headers or {})},
        )
        assert status == 200, data
        return parse_sse(data)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, by its name with labels (`name{labels}`)."""
        status, data = self.get("/metrics")
        assert status == 200
        samples = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                samples[key] = float(value)
        return samples

    def metric(self, name: str) -> float:
        """Sum of a metric's samples over all label sets."""
        total = 0.0
        for key, value in self.metrics().items():
            if key == name or key.startswith(name + "{"):
                total += value
        return total


def parse_sse(data: bytes) -> list[Any]:
    text = data.decode()
    assert text.endswith("\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def descendants(root: int) -> set[int]:
    """Pids of every process below `root`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found.add(child)
            todo.append(child)
    return found


def port_is_free(host: str, port: int) -> bool:
    """Nothing answers on `port` and a new server could bind it (with SO_REUSEADDR, as uvicorn
    binds, so that connections left in TIME_WAIT do not count)."""
    with socket.socket() as probe:
        probe.settimeout(2.0)
        if probe.connect_ex((host, port)) == 0:
            return False
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def shm_entries(pids: Iterable[int] | None = None) -> set[str]:
    """The `tpe-*` names in /dev/shm; with `pids`, only the ones those processes created.

    A segment's name starts with its creator's pid (`shm_ipc.handle.RunNames`), so a leak check
    scoped to a run's own processes cannot read another run's segments (a second pytest worker,
    another test run on the machine) as its leaks."""
    names = {name for name in os.listdir("/dev/shm") if name.startswith("tpe-")}
    if pids is None:
        return names
    prefixes = tuple(f"tpe-{pid}-" for pid in pids)
    return {name for name in names if name.startswith(prefixes)}


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
