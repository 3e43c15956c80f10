"""sglang-router as a child process: its command line and the parts of its admin API we use.

The router is a Rust load balancer in the `sglang-router` package (`pip install
'tp-engine[router]'`); `python -m sglang_router.launch_router` runs it in that Python process.
We never route ourselves: the data-parallel launcher (`tp_engine.server.rank0.replicas`) starts it in
front of the replicas and tells it, through its HTTP admin API (`/workers`), when a replica
has died or come back, which is faster and surer than its own periodic health checks.

The router holds nothing on disk or in /dev/shm, so it is tied to the launcher with the kernel's
parent-death signal: however the launcher ends (SIGKILL included), the router is killed too.

Its admin API shares the serving port and is open by default: anyone who can reach the port
could add a worker of their own or remove ours. Each run makes a random admin key
(`--control-plane-api-keys`, role admin; or $TP_ENGINE_ROUTER_ADMIN_KEY) that only the launcher
sends; clients' routes are not affected. (The key is on the router's command line until
sglang-router rewrites its process title: a local user could catch it at start-up, a remote
client cannot.)
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any

ROUTER_ADMIN_KEY_ENV = "TP_ENGINE_ROUTER_ADMIN_KEY"
# prctl(2) option: the signal this process gets when the thread that forked it exits.
_PR_SET_PDEATHSIG = 1
_HEALTH_CHECK_INTERVAL_S = 5
# Seconds for one admin request; the router answers them from memory.
_ADMIN_TIMEOUT_S = 5.0


def router_installed() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


def new_admin_key() -> str:
    """$TP_ENGINE_ROUTER_ADMIN_KEY (to manage the router yourself too), else a random one."""
    return os.environ.get(ROUTER_ADMIN_KEY_ENV) or secrets.token_urlsafe(32)


def router_command(
    host: str,
    port: int,
    worker_urls: list[str],
    policy: str,
    prometheus_port: int,
    shutdown_grace_s: float,
    admin_key: str,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        # In-flight requests get as long as the replicas give theirs on SIGTERM.
        "--shutdown-grace-period-secs",
        str(max(1, round(shutdown_grace_s))),
        # Its circuit breaker counts a client's 400s as the replica's failures: ten bad requests
        # would take a healthy replica out of service for a minute. A replica that dies is
        # removed by the launcher at once; one whose engine died answers /health with 503,
        # which the router's health checks (every few seconds) act on.
        "--disable-circuit-breaker",
        "--health-check-interval-secs",
        str(_HEALTH_CHECK_INTERVAL_S),
        # The admin API (/workers) answers the launcher alone (id:name:role:key).
        "--control-plane-api-keys",
        f"launcher:tp-engine launcher:admin:{admin_key}",
        # Its per-request lines would drown the replicas' log; warnings and errors still show.
        "--log-level",
        "warn",
    ]


def die_with_parent() -> None:
    """`preexec_fn` of the router's Popen: SIGKILL it when the launcher's main thread ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getppid()
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the launcher died before the signal was armed
        os._exit(1)


class RouterAdmin:
    """The router's admin routes (`/readiness`, `/workers`), on its serving port."""

    def __init__(self, base_url: str, admin_key: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {admin_key}"}

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {**self._auth, **({"Content-Type": "application/json"} if data else {})}
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers=headers
        )
        with urllib.request.urlopen(req, timeout=_ADMIN_TIMEOUT_S) as resp:
            text = resp.read()
        return json.loads(text) if text else None

    def healthy_workers(self) -> int | None:
        """How many workers the router would route to now; None if it does not answer."""
        try:
            return int(self._call("GET", "/readiness").get("healthy_workers", 0))
        except urllib.error.HTTPError as exc:  # 503 while no worker is healthy
            return 0 if exc.code == 503 else None
        except (OSError, ValueError):
            return None

    def workers(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/workers").get("workers", []))

    def remove_worker(self, url: str) -> bool:
        """Stop routing to `url` (the removal is queued in the router, done within
        milliseconds). False if it was not registered."""
        ids = [w["id"] for w in self.workers() if w.get("url") == url]
        for worker_id in ids:
            self._call("DELETE", f"/workers/{worker_id}")
        return bool(ids)

    def add_worker(self, url: str) -> None:
        """Register `url` (the router probes it as at start-up: health, /server_info,
        /model_info)."""
        self._call("POST", "/workers", {"url": url})

    def wait_for_workers(self, count: int, timeout_s: float, keep_waiting: Any) -> bool:
        """Until the router routes to `count` workers; False on timeout or once
        `keep_waiting()` is false."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and keep_waiting():
            if (self.healthy_workers() or 0) >= count:
                return True
            time.sleep(0.1)
        return False
