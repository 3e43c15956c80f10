"""`launch/serve.py --data-parallel-size N`: N engine replicas behind sglang-router.

    launcher (this process)
     ├── replica 0: `python -m tp_engine.server ... --port P0 --replica-index 0`  devices 0..M-1
     │     (rank 0 + its API process + ranks 1..M-1, exactly as a plain `serve.py` run)
     ├── replica 1: ... --port P1 --replica-index 1                              devices M..2M-1
     └── router:    `python -m sglang_router.launch_router --worker-urls P0 P1 ...` on --host/--port

Nothing inside a replica knows about the others: each is an ordinary run with its own run
directory, shared-memory names and private port (127.0.0.1, picked free), and on GPUs its own
devices (CUDA_VISIBLE_DEVICES narrowed to its M). On CPU all share the cores, split evenly.

Lifecycle:
- start-up: the replicas load in parallel; the router starts once every replica answers
  /health, and the run is announced once the router routes to all of them. A replica that
  exits during start-up fails the run (exit 1), naming it.
- a replica that dies is reported by name and removed from the router at once (its admin API);
  the others keep serving. With `--restart-dead-replicas` it is started again on its port and
  devices (after a back-off that doubles while it keeps dying) and re-added once healthy.
  Without, the run ends when no replica is left.
- SIGINT/SIGTERM: forwarded to every replica (each drains for its `--shutdown-timeout`) and to
  the router (which lets its in-flight requests finish); exit 0.
- SIGKILL of this launcher: each replica's rank 0 watches it (`--replica-index` arms the same
  launcher watch torchrun's ranks use) and ends its run, cleaning up its files; the router dies
  with it (parent-death signal). Replicas and router run in sessions of their own, so a
  terminal's Ctrl-C reaches only this process, which then shuts everything down in order.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from tp_engine.server.args import DEMO_MODEL_NAME
from tp_engine.server.rank0.router_process import (
    RouterAdmin,
    die_with_parent,
    new_admin_key,
    router_command,
    router_installed,
)

logger = logging.getLogger("tp_engine.server.rank0.replicas")

_POLL_S = 0.1
# A model can take long to load; the launcher waits as long as the router would.
_STARTUP_TIMEOUT_S = 1800.0
_ROUTER_READY_TIMEOUT_S = 120.0
# Back-off before restarting a replica that died: doubles per death in a row, up to the cap.
_RESTART_BACKOFF_S = (1.0, 30.0)
# A replica healthy this long is no longer "dying in a row".
_STABLE_S = 60.0
# How long stopped processes get beyond their own drain before they are killed.
_EXIT_MARGIN_S = 15.0


@dataclass
class Replica:
    index: int
    port: int
    # CUDA_VISIBLE_DEVICES for it; None on CPU.
    devices: list[str] | None
    proc: subprocess.Popen | None = None
    # Registered with the router (healthy and announced).
    routed: bool = False
    deaths_in_a_row: int = 0
    healthy_since: float | None = None
    restart_at: float | None = None
    history: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        where = f"devices {','.join(self.devices)}" if self.devices is not None else "CPU"
        pid = self.proc.pid if self.proc is not None else "-"
        return f"replica {self.index} (pid {pid}, {self.url}, {where})"


def device_slices(dp_size: int, tp_size: int, visible: list[str] | None) -> list[list[str] | None]:
    """Replica i's devices: i*M .. i*M+M-1 of the visible ones (None each without GPUs)."""
    if visible is None:
        return [None] * dp_size
    need = dp_size * tp_size
    if len(visible) < need:
        raise ValueError(
            f"--data-parallel-size {dp_size} x --tensor-parallel-size {tp_size} needs {need} "
            f"GPUs; {len(visible)} are visible"
        )
    return [visible[i * tp_size : (i + 1) * tp_size] for i in range(dp_size)]


def visible_gpus() -> list[str] | None:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries; None without any."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]


def check_args(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if not 0 < args.router_prometheus_port <= 65535:
        raise ValueError("--router-prometheus-port must be in [1, 65535]")
    if not router_installed():
        raise ValueError(
            "--data-parallel-size needs sglang-router: pip install 'tp-engine[router]' "
            "(or pip install sglang-router)"
        )


_FIRST_PORT = 20000  # above the registered ports most services listen on


def free_port(host: str) -> int:
    """A port of `host` that is free now, for a process that binds it seconds later (the router,
    a replica). Drawn below the kernel's ephemeral range where it can be read: a port from that
    range (what `bind(0)` gives) is also what the kernel gives every outgoing connection and
    every other `bind(0)` meanwhile, so on a busy host it can be taken before it is bound
    (seen: the router's "Address already in use")."""
    low = _ephemeral_low()
    if low > _FIRST_PORT:
        for port in random.sample(range(_FIRST_PORT, low), min(64, low - _FIRST_PORT)):
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port the kernel hands out on its own (Linux); 0 where unknown."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def replica_command(argv: list[str], replica: Replica) -> list[str]:
    """The launcher's own arguments, then what makes it one replica (later flags win)."""
    return [
        sys.executable,
        "-m",
        "tp_engine.server",
        *argv,
        "--host",
        "127.0.0.1",
        "--port",
        str(replica.port),
        "--replica-index",
        str(replica.index),
    ]


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as resp:
            return resp.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class ReplicaSet:
    def __init__(self, args: argparse.Namespace, argv: list[str], tp_size: int) -> None:
        """ValueError for a bad setting, before any process starts."""
        check_args(args)
        self.args = args
        self.argv = argv
        self.tp_size = tp_size
        self.dp_size = args.data_parallel_size
        self.router_host = args.host
        connect_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        self.router_port = args.port or free_port(connect_host)
        self.connect_url = f"http://{_url_host(connect_host)}:{self.router_port}"
        self.admin_key = new_admin_key()
        self.admin = RouterAdmin(self.connect_url, self.admin_key)
        devices = device_slices(self.dp_size, tp_size, visible_gpus())
        self.replicas = [
            Replica(i, free_port("127.0.0.1"), devices[i]) for i in range(self.dp_size)
        ]
        self.router: subprocess.Popen | None = None
        self._stop_signal: int | None = None

    # -- the run -----------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            code = self._serve()
        except BaseException:
            self._kill_all()
            raise
        self._stop_all()
        return code

    def _serve(self) -> int:
        for replica in self.replicas:
            self._start(replica)
        if not self._wait_all_healthy():
            return 0 if self._stop_signal is not None else 1
        self.router = subprocess.Popen(
            router_command(
                self.router_host,
                self.router_port,
                [r.url for r in self.replicas],
                self.args.router_policy,
                self.args.router_prometheus_port,
                self.args.shutdown_timeout,
                self.admin_key,
            ),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        ready = self.admin.wait_for_workers(
            self.dp_size,
            _ROUTER_READY_TIMEOUT_S,
            lambda: self._stop_signal is None and self.router.poll() is None,
        )
        if not ready:
            if self._stop_signal is not None:
                return 0
            logger.error("the router did not start routing to all %d replicas", self.dp_size)
            return 1
        now = time.monotonic()
        for replica in self.replicas:
            replica.routed, replica.healthy_since = True, now
        name = self.args.served_model_name[0] if self.args.served_model_name else None
        logger.info(
            "router (%s) serving %s from %d replicas x tensor parallel %d on http://%s:%d; "
            "router metrics on http://%s:%d/metrics, each replica's at <replica>/metrics",
            self.args.router_policy,
            name or self.args.model or DEMO_MODEL_NAME,
            self.dp_size,
            self.tp_size,
            _url_host(self.router_host),
            self.router_port,
            _url_host(self.router_host),
            self.args.router_prometheus_port,
        )
        return self._supervise()

    def _supervise(self) -> int:
        while self._stop_signal is None:
            if self.router is not None and self.router.poll() is not None:
                logger.error(
                    "the router %s: ending the run", _describe_exit(self.router.returncode)
                )
                return 1
            now = time.monotonic()
            for replica in self.replicas:
                self._check(replica, now)
            if not self.args.restart_dead_replicas and all(
                r.proc is None or r.proc.poll() is not None for r in self.replicas
            ):
                logger.error("no replica is left: ending the run")
                return 1
            time.sleep(_POLL_S)
        return 0

    def _check(self, replica: Replica, now: float) -> None:
        proc = replica.proc
        if proc is not None and proc.poll() is not None:
            self._on_death(replica, proc.returncode, now)
        elif proc is None and replica.restart_at is not None and now >= replica.restart_at:
            replica.restart_at = None
            logger.warning(
                "restarting replica %d (restart %d)", replica.index, len(replica.history)
            )
            self._start(replica)
        elif proc is not None and not replica.routed and _health(replica.url):
            self.admin.add_worker(replica.url)
            replica.routed, replica.healthy_since = True, now
            logger.info("%s is serving again; back in the router", replica.name)
        if (
            replica.healthy_since is not None
            and replica.deaths_in_a_row
            and now - replica.healthy_since > _STABLE_S
        ):
            replica.deaths_in_a_row = 0

    def _on_death(self, replica: Replica, code: int, now: float) -> None:
        # Out of the router first: every request from now on goes to the others.
        removed = False
        if replica.routed:
            try:
                removed = self.admin.remove_worker(replica.url)
            except (OSError, ValueError) as exc:
                logger.error("could not remove %s from the router: %s", replica.url, exc)
        serving = sum(1 for r in self.replicas if r.proc is not None and r.proc.poll() is None)
        logger.error(
            "%s %s%s; %d of %d replicas serving",
            replica.name,
            _describe_exit(code),
            "; removed from the router" if removed else "",
            serving,
            self.dp_size,
        )
        replica.proc, replica.routed, replica.healthy_since = None, False, None
        replica.history.append(code)
        if self.args.restart_dead_replicas:
            low, high = _RESTART_BACKOFF_S
            delay = min(high, low * 2**replica.deaths_in_a_row)
            replica.deaths_in_a_row += 1
            replica.restart_at = now + delay
            logger.warning("replica %d restarts in %.0f s", replica.index, delay)

    # -- processes ---------------------------------------------------------------------------------

    def _start(self, replica: Replica) -> None:
        env = dict(os.environ)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(name, None)
        if replica.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(replica.devices)
        elif "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.dp_size))
        # Its own session: a terminal's Ctrl-C reaches only the launcher, which drains in order.
        replica.proc = subprocess.Popen(
            replica_command(self.argv, replica),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        logger.info("started %s", replica.name)

    def _wait_all_healthy(self) -> bool:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        pending = list(self.replicas)
        while pending and time.monotonic() < deadline:
            if self._stop_signal is not None:
                return False
            for replica in list(pending):
                assert replica.proc is not None
                if replica.proc.poll() is not None:
                    logger.error(
                        "%s %s during start-up (its log above says why): ending the run",
                        replica.name,
                        _describe_exit(replica.proc.returncode),
                    )
                    return False
                if _health(replica.url):
                    pending.remove(replica)
            time.sleep(_POLL_S)
        if pending:
            logger.error("replicas %s did not start in time", [r.index for r in pending])
        return not pending

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stop_signal is None:
            logger.info("signal %d: draining every replica", signum)
        self._stop_signal = signum

    def _stop_all(self) -> None:
        """SIGTERM to every replica (each drains) and to the router, then wait; whatever is
        still running past its time is killed."""
        procs = [r.proc for r in self.replicas if r.proc is not None]
        if self.router is not None:
            procs.append(self.router)
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.shutdown_timeout + _EXIT_MARGIN_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("pid %d did not exit in time: killing it", proc.pid)
                proc.kill()
                proc.wait()

    def _kill_all(self) -> None:
        for proc in [r.proc for r in self.replicas] + [self.router]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
