"""Ranks 1..N-1: serve rank 0 until it says EXIT, one plan after another.

A worker holds no request state. It receives the `Bootstrap` (`rank_worker.dist.bootstrap`), loads
its shard, then runs every message rank 0 publishes (plans, and control calls between them)
through the same `StepExecutor` as rank 0 (`rank_worker.dist.step`), whose `dispatch` decides what
each one is. A refused or failed control call is a returned value, not an exception (see
`rank_worker.control.protocol`). A worker that fails reports the exception on the channel's back channel
(rank 0 turns it into an error naming this rank) and exits non-zero; a worker whose rank 0 died
exits non-zero too, and so does one whose launcher died (`rank_worker.dist.launcher_watch`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from rank_worker.dist.bootstrap import Bootstrap
from rank_worker.fault_injection import Fault
from rank_worker.dist.launcher_watch import LauncherWatch
from rank_worker.tp import TPInfo, destroy_process_group
from shm_ipc import OwnerDiedError, PlanReceiver
from shm_ipc.errors import ChannelClosed
from shm_ipc.liveness import ParentWatch

logger = logging.getLogger(__name__)

# Exit codes of a worker process.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_OWNER_DIED = 3
EXIT_LAUNCHER_GONE = 4

# A spawned worker's parent is rank 0: once it is gone, `recv` and the owner watchdog normally
# end the worker within this; the launcher watch is the backstop (and covers start-up).
SPAWNED_WORKER_GRACE_S = 3.0


def run_worker(
    tp: TPInfo,
    fault: Fault | None = None,
    on_owner_death: Callable[[], None] | None = None,
) -> int:
    """Serve rank 0 until it sends EXIT; returns the process exit code.

    `on_owner_death` runs if rank 0 dies first (e.g. to remove rendezvous files that only rank 0
    would otherwise clean up).
    """
    from rank_worker.runner.model_runner import ModelRunner  # deferred: pulls in the model code
    from rank_worker.dist.step import Flow, StepExecutor
    from rank_worker.kv.pd_agent import start_kv_agent

    if tp.is_first:
        raise ValueError("run_worker is for ranks 1..N-1; rank 0 runs the engine")
    boot = Bootstrap.receive(tp)
    receiver = PlanReceiver(boot.channel, tp.rank)
    if receiver.remote:
        logger.info(
            "rank %d (node %d): plans from rank 0 over %s",
            tp.rank,
            tp.node,
            boot.channel.remote_plan_address,
        )
    _start_owner_watchdog(receiver, tp.rank, on_owner_death)
    step_id: int | None = None
    try:
        runner = ModelRunner(boot.model_dir, boot.runner_config, tp, tp.device)
        runner.init_kv_cache(runner.determine_num_kv_blocks())
        # Held for the loop's life: its transfer engine holds the cache registered.
        kv_agent = start_kv_agent(runner, tp.rank)
        executor = StepExecutor(runner, tp, fault)
        while True:
            message = receiver.recv()
            step_id = message.step_id
            if executor.dispatch(message) is Flow.EXIT:
                if kv_agent is not None:
                    kv_agent.close()
                return EXIT_OK
    except (OwnerDiedError, ChannelClosed) as exc:
        logger.error("%s", exc)  # the message names this rank
        return EXIT_OWNER_DIED
    except BaseException as exc:
        # Tell rank 0 what happened before the process group notices this rank is gone.
        receiver.report_error(step_id, exc)
        logger.exception("rank %d failed at step %s", tp.rank, step_id)
        return EXIT_FAILED
    finally:
        receiver.close()
        # Whichever way this rank noticed (recv, or a collective that broke mid-step).
        if on_owner_death is not None and not receiver.owner_alive():
            on_owner_death()


def _start_owner_watchdog(
    receiver: PlanReceiver, rank: int, on_owner_death: Callable[[], None] | None
) -> None:
    """Exit this process if rank 0 dies while this rank is blocked somewhere other than `recv`.

    `recv` notices a dead rank 0 by itself; a rank blocked inside a collective would otherwise
    wait for the process group's timeout (NCCL does not notice a vanished peer), holding its GPU.
    The watchdog waits for two consecutive checks so that `recv`'s own, cleaner exit wins when
    the rank is idle.
    """

    def watch() -> None:
        dead_checks = 0
        while dead_checks < 2:
            time.sleep(1.0)
            dead_checks = dead_checks + 1 if not receiver.owner_alive() else 0
        logger.error("rank %d: rank 0 is gone; exiting", rank)
        if on_owner_death is not None:
            on_owner_death()
        os._exit(EXIT_OWNER_DIED)

    threading.Thread(target=watch, name=f"rank{rank}-owner-watchdog", daemon=True).start()


def watch_launcher(
    parent: ParentWatch,
    rank: int,
    *,
    what: str = "the launcher",
    grace_s: float,
    exit_code: int = EXIT_LAUNCHER_GONE,
    on_overdue: Callable[[], None] | None = None,
) -> LauncherWatch:
    """Exit this worker `grace_s` after the process that launched it (`parent`, taken at start)
    is gone, unless rank 0 has ended the run by then; `on_overdue` runs just before."""

    def on_gone(message: str) -> None:
        logger.error("rank %d: %s; exiting within %g s", rank, message, grace_s)

    return LauncherWatch(
        parent,
        what,
        on_gone,
        grace_s=grace_s,
        exit_code=exit_code,
        on_overdue=None if on_overdue is None else lambda message: on_overdue(),
    ).start()


def main() -> int:
    """Entry point of a worker process started by `rank_worker.dist.local_group.spawn_local_group`."""
    from rank_worker.dist.local_group import join_local_group, remove_group_dir

    parent = ParentWatch()  # rank 0, which spawned this process
    fault = Fault.from_env()  # a malformed spec fails this rank before it joins
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # From before joining the group: a rank 0 that dies during start-up cannot leave this
    # process waiting for the store's timeout.
    watch = watch_launcher(
        parent,
        int(os.environ["RANK"]),
        what="rank 0",
        grace_s=SPAWNED_WORKER_GRACE_S,
        exit_code=EXIT_OWNER_DIED,
        on_overdue=remove_group_dir,
    )
    tp = join_local_group()
    try:
        return run_worker(tp, fault, on_owner_death=remove_group_dir)
    finally:
        watch.stop()  # rank 0 exits right after its EXIT: not a death to report
        destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
