"""How a process becomes a rank: the one bring-up path of `LLM` and `launch/serve.py`.

    launched as                        this process                  ranks 1..N-1
    torchrun --nproc-per-node N ...    one rank (RANK, WORLD_SIZE,   torchrun's other processes
                                       LOCAL_RANK from torchrun)
    python ..., tensor parallel N > 1  rank 0                        spawned here (`local_group`)
    python ..., N = 1                  rank 0 of a group of one      none
    python ... --nnodes M --node-rank  node R's first rank, R*N/M    this node's others spawned
      R (on each of M nodes)           (rank 0 on node 0)            here, the rest by the
                                                                     other nodes' launchers

`start` joins or makes the group and returns a `Ranks`: this rank's `TPInfo` (device
included), the fault the tests asked for, and what must be released at the end (spawned
children, the process group). A rank other than 0 then serves rank 0 (`serve_as_worker`) until
told to exit. Under torchrun every rank also watches the agent that launched it
(`launcher_watch`): `torchrun_launcher()` takes it first thing, before anything slow, since once
the agent is dead `os.getppid()` names whoever adopted the process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from rank_worker.fault_injection import Fault
from rank_worker.dist.launcher_watch import TORCHRUN_WORKER_GRACE_S, LauncherWatch
from rank_worker.dist.local_group import LocalGroup, NodeSpec, spawn_local_group
from rank_worker.tp import TPInfo, destroy_process_group, init_process_group
from shm_ipc.liveness import ParentWatch

logger = logging.getLogger(__name__)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_rank() -> int | None:
    """This process's rank under torchrun (known before the group is joined), else None."""
    return int(os.environ["RANK"]) if under_torchrun() else None


def torchrun_launcher() -> ParentWatch | None:
    """torchrun's agent, to watch; None when this process is not a torchrun rank (then it is
    the launcher itself). Call it first thing in the process."""
    return ParentWatch() if under_torchrun() else None


def tensor_parallel_size(requested: int | None, pipeline_parallel_size: int = 1) -> int:
    """The tensor-parallel size: under torchrun WORLD_SIZE / pipeline_parallel_size (the world
    is TP x PP ranks), else `requested` (default 1). ValueError when torchrun's WORLD_SIZE is
    not `requested` x pipeline_parallel_size, or not a multiple of pipeline_parallel_size."""
    if not under_torchrun():
        return requested or 1
    world_size = int(os.environ["WORLD_SIZE"])
    pp = pipeline_parallel_size
    tp = requested if requested is not None else world_size // max(pp, 1)
    if tp * pp != world_size:
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} but torchrun started "
            f"{world_size} ranks; they must match"
        )
    return tp


@dataclass
class Ranks:
    """This process's place in a running group, and what it must release at the end."""

    tp: TPInfo
    # `$TP_ENGINE_FAULT`, parsed before joining (a malformed spec fails the start-up at once).
    fault: Fault | None
    # torchrun's agent, watched; None when this process launched the run.
    launcher: ParentWatch | None
    # Ranks 1..N-1 this process spawned (plain Python, N > 1).
    group: LocalGroup | None = None
    # A torchrun worker's watch of the agent (rank 0's belongs to its front end).
    watch: LauncherWatch | None = None
    # Whether `start` created a process group (a group of one creates none).
    owns_group: bool = True

    def release(self, dead: bool, worker_exit_timeout_s: float = 10.0) -> None:
        """Stop spawned ranks (killed when `dead`, else given the timeout to exit after EXIT)
        and leave the process group. Idempotent."""
        # The reference stays: a watchdog thread's `group.kill()` during this call must wait
        # for the directory to be gone before its process exits (`LocalGroup._release`).
        if self.group is not None:
            if dead:
                self.group.kill()
            else:
                self.group.wait(worker_exit_timeout_s)
        if self.owns_group:
            self.owns_group = False
            destroy_process_group()


def start(
    tp_size: int, backend: str | None, launcher: ParentWatch | None, node: NodeSpec | None = None
) -> Ranks:
    """Join torchrun's group, or spawn ranks 1..tp_size-1 and be rank 0, or (`node`) spawn this
    node's ranks and be its first, or be a group of one (see the module docstring). Raises
    naming a spawned rank that failed to start or a node that did not join. `tp_size`: the
    world's size, TP x PP ranks under pipeline parallelism."""
    fault = Fault.from_env()
    if node is not None and node.nnodes > 1:
        tp, group = spawn_local_group(tp_size, backend, node)
        return Ranks(tp, fault, None, group)
    if launcher is not None:
        watch = None
        if torchrun_rank() != 0:
            # From before the rendezvous: an agent that dies during it cannot leave this rank
            # waiting for the store's timeout.
            from rank_worker.dist.worker import watch_launcher

            watch = watch_launcher(launcher, torchrun_rank() or 0, grace_s=TORCHRUN_WORKER_GRACE_S)
        tp = init_process_group(backend)
        return Ranks(tp, fault, launcher, watch=watch, owns_group=not tp.is_single)
    if tp_size > 1:
        tp, group = spawn_local_group(tp_size, backend)
        return Ranks(tp, fault, None, group)
    tp = init_process_group(backend, rank=0, world_size=1)
    return Ranks(tp, fault, None, owns_group=False)


def serve_as_worker(ranks: Ranks) -> int:
    """A torchrun rank other than 0: serve rank 0 until it sends EXIT, then leave the group;
    returns the exit code. Exits on its own if torchrun's agent is gone and rank 0 has not
    ended the run in time (`TORCHRUN_WORKER_GRACE_S`)."""
    from rank_worker.dist.worker import run_worker

    assert not ranks.tp.is_first
    code = 1
    try:
        code = run_worker(ranks.tp, ranks.fault)
        return code
    finally:
        if ranks.watch is not None:
            ranks.watch.stop()  # rank 0 ended the run: its exit is not a death to report
        ranks.release(dead=code != 0)
