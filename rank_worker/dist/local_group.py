"""Start ranks 1..N-1 as child processes of this one (rank 0), for `LLM` outside torchrun; or,
across nodes (`tp-engine serve --nnodes M --node-rank R`), this node's ranks.

On one node the ranks meet through a `FileStore` in a private (0700) per-run directory rather
than a TCP port: nothing listens on the network, and there is no pick-a-free-port race. Across
nodes they meet in a `TCPStore` that node 0's rank 0 hosts on `--master-addr:--master-port`
(`NodeSpec`); each node's launcher process is its first rank and spawns the others. Each child
announces itself in the store before joining the process group, so its launcher waits for it
with a short poll that notices a child which died on the way (bad environment, import error) and
names it, instead of blocking for the process group's whole timeout. Each node announces itself
too, so node 0 names a node that never joins (`--node-join-timeout`) rather than waiting for
torch's rendezvous timeout.
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

from rank_worker.tp import ENV_NODE_RANK, TPInfo, init_process_group
from shm_ipc.paths import private_dir

# Environment of a spawned worker (besides torchrun's RANK / WORLD_SIZE / LOCAL_RANK).
ENV_STORE = "TP_ENGINE_STORE"
ENV_BACKEND = "TP_ENGINE_DIST_BACKEND"
ENV_THREADS = "TP_ENGINE_WORKER_THREADS"

# How long rank 0 waits for every child to announce itself.
STARTUP_TIMEOUT_S = 120.0
_POLL_S = 0.2


@dataclass(frozen=True)
class NodeSpec:
    """This node's place in a run over `nnodes` nodes (`tp-engine serve --nnodes`)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    join_timeout_s: float = 300.0

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.nnodes:
            raise ValueError(
                f"{world_size} ranks do not split evenly over --nnodes {self.nnodes}"
            )
        return world_size // self.nnodes

    def ranks_of(self, node: int, world_size: int) -> range:
        per_node = self.ranks_per_node(world_size)
        return range(node * per_node, (node + 1) * per_node)

    @property
    def store_url(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def node_key(node: int) -> str:
    return f"node/{node}"


def open_store(path: str, world_size: int, is_master: bool = False) -> dist.Store:
    """The run's store: a file (one node) or, for a `tcp://HOST:PORT` path, node 0's TCPStore
    (hosted by the caller when `is_master`)."""
    if path.startswith("tcp://"):
        host, _, port = path[len("tcp://") :].rpartition(":")
        return dist.TCPStore(
            host,
            int(port),
            world_size,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
            wait_for_workers=False,
        )
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
                if self.run_dir:  # none across nodes: the store is node 0's TCPStore
                    remove_tree(self.run_dir)
                self._released = True


def spawn_local_group(
    world_size: int, backend: str | None = None, node: NodeSpec | None = None
) -> tuple[TPInfo, LocalGroup]:
    """Start this node's other ranks and join them as its first: ranks 1..world_size-1 as rank 0
    on one node, or node `node.node_rank`'s share of a run over several. Raises naming a child
    that died or, on node 0, a node that did not join in time."""
    if node is None:
        run_dir = private_dir("tpe-group-")
        store_path = os.path.join(run_dir, "store")
        ranks = range(world_size)
    else:
        run_dir = ""
        store_path = node.store_url
        ranks = node.ranks_of(node.node_rank, world_size)
    first = ranks[0]
    threads = max(1, (os.cpu_count() or 1) // len(ranks))
    node_env = {} if node is None else {ENV_NODE_RANK: str(node.node_rank)}
    procs = []
    for rank in ranks[1:]:
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank - first),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(len(ranks)),
            **node_env,
            **{ENV_STORE: store_path, ENV_BACKEND: backend or "", ENV_THREADS: str(threads)},
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "rank_worker.dist.worker"], env=env))
    group = LocalGroup(procs, run_dir)
    try:
        if not torch.cuda.is_available():
            # N ranks on one machine would each start a thread per core; share the cores.
            torch.set_num_threads(threads)
        if node is not None:
            os.environ.update(node_env, LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(len(ranks)))
        store = open_store(store_path, world_size, is_master=first == 0)
        if node is not None:
            store.set(node_key(node.node_rank), b"1")
        _wait_for_children(store, procs, first)
        if node is not None and node.node_rank == 0:
            _wait_for_nodes(store, node, world_size)
        tp = init_process_group(backend, rank=first, world_size=world_size, store=store)
    except BaseException:
        group.kill()
        raise
    return tp, group


def _wait_for_nodes(store: dist.Store, node: NodeSpec, world_size: int) -> None:
    """Node 0: every other node has announced itself, or an error naming the ones missing."""
    deadline = time.monotonic() + node.join_timeout_s
    pending = set(range(1, node.nnodes))
    while pending:
        pending = {n for n in pending if not store.check([node_key(n)])}
        if pending and time.monotonic() > deadline:
            missing = ", ".join(
                f"node {n} (ranks {list(node.ranks_of(n, world_size))})" for n in sorted(pending)
            )
            raise TimeoutError(
                f"{missing} did not join within {node.join_timeout_s:g} s: is "
                f"`tp-engine serve ... --nnodes {node.nnodes} --node-rank N --master-addr "
                f"{node.master_addr} --master-port {node.master_port}` running there, and can "
                f"it reach {node.master_addr}:{node.master_port}?"
            )
        if pending:
            time.sleep(_POLL_S)


def _wait_for_children(store: dist.Store, procs: list[subprocess.Popen], first: int) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = {rank: proc for rank, proc in enumerate(procs, start=first + 1)}
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
    """In a spawned child whose rank 0 died: remove the rendezvous directory rank 0 made (none
    across nodes: their store is node 0's TCPStore)."""
    store = os.environ[ENV_STORE]
    if not store.startswith("tcp://"):
        remove_tree(os.path.dirname(store))


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
