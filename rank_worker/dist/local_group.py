"""Start ranks 1..N-1 as child processes of this one (rank 0), for `LLM` outside torchrun.

The ranks meet through a `FileStore` in a private (0700) per-run directory rather than a TCP
port: nothing listens on the network, and there is no pick-a-free-port race. Each child announces
itself in the store before joining the process group, so rank 0 waits for them with a short poll
that notices a child which died on the way (bad environment, import error) and names it, instead
of blocking for the process group's whole timeout.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rank_worker.tp import TPInfo, init_process_group
from shm_ipc.paths import private_dir

# Environment of a spawned worker (besides torchrun's RANK / WORLD_SIZE / LOCAL_RANK).
ENV_STORE = "TP_ENGINE_STORE"
ENV_BACKEND = "TP_ENGINE_DIST_BACKEND"
ENV_THREADS = "TP_ENGINE_WORKER_THREADS"

# How long rank 0 waits for every child to announce itself.
STARTUP_TIMEOUT_S = 120.0
_POLL_S = 0.2


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def open_store(path: str, world_size: int) -> dist.FileStore:
    store = dist.FileStore(path, world_size)
    store.set_timeout(datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    return store


@dataclass
class LocalGroup:
    """The child processes of a locally spawned run and their rendezvous directory."""

    procs: list[subprocess.Popen]
    run_dir: str
    _released: bool = field(default=False, repr=False)
    # `kill` may come from a watchdog thread while the main thread is in `wait` or `kill`: the
    # second caller waits until the directory is gone (it may `os._exit` right after).
    _release_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait(self, timeout_s: float) -> None:
        """Let the children exit on their own (after EXIT), killing any still alive at the end."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._release()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        self._release()

    def _release(self) -> None:
        with self._release_lock:
            if not self._released:
                remove_tree(self.run_dir)
                self._released = True


def spawn_local_group(world_size: int, backend: str | None = None) -> tuple[TPInfo, LocalGroup]:
    """Start ranks 1..world_size-1 and join them as rank 0; raises naming a child that died."""
    run_dir = private_dir("tpe-group-")
    store_path = os.path.join(run_dir, "store")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = []
    for rank in range(1, world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            **{ENV_STORE: store_path, ENV_BACKEND: backend or "", ENV_THREADS: str(threads)},
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "rank_worker.dist.worker"], env=env))
    group = LocalGroup(procs, run_dir)
    try:
        if not torch.cuda.is_available():
            # N ranks on one machine would each start a thread per core; share the cores.
            torch.set_num_threads(threads)
        store = open_store(store_path, world_size)
        _wait_for_children(store, procs)
        tp = init_process_group(backend, rank=0, world_size=world_size, store=store)
    except BaseException:
        group.kill()
        raise
    return tp, group


def _wait_for_children(store: dist.FileStore, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = {rank: proc for rank, proc in enumerate(procs, start=1)}
    while pending:
        for rank, proc in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode} before "
                    "joining the process group; its output above says why"
                )
            if store.check([ready_key(rank)]):
                del pending[rank]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks {sorted(pending)} did not start within {STARTUP_TIMEOUT_S:.0f} s"
            )
        if pending:
            time.sleep(_POLL_S)


def remove_tree(path: str, attempts: int = 5) -> None:
    """Remove `path` and everything in it. Retried: a rank leaving the process group at the
    same moment can write the store's file again between `rmtree`'s unlink and its rmdir."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.05)


def remove_group_dir() -> None:
    """In a spawned child whose rank 0 died: remove the rendezvous directory rank 0 made."""
    remove_tree(os.path.dirname(os.environ[ENV_STORE]))


def join_local_group() -> TPInfo:
    """In a spawned child: announce this rank to rank 0, then join the process group."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get(ENV_THREADS, torch.get_num_threads())))
    store = open_store(os.environ[ENV_STORE], world_size)
    store.set(ready_key(rank), b"1")
    return init_process_group(
        os.environ.get(ENV_BACKEND) or None, rank=rank, world_size=world_size, store=store
    )
