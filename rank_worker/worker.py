"""Ranks 1..N-1: join rank 0's run, then execute every StepPlan it publishes until EXIT.

Start-up, in the same order on every rank (rank 0's side is `tp_engine.engine.LLMEngine`):

1. the process group is up (`init_process_group`);
2. rank 0 broadcasts a `Bootstrap` (checkpoint, `RunnerConfig`, channel handle) as bytes;
3. each worker attaches a `PlanReceiver`, which says hello to rank 0;
4. every rank loads its weight shard and agrees on the number of KV blocks (a collective);
5. workers loop: receive a plan, run the forward pass, repeat. EXIT ends the loop.

A worker that fails reports the exception on the channel's back channel (rank 0 turns it into an
error naming this rank) and exits non-zero; a worker whose rank 0 died exits non-zero too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import msgpack
import torch

from rank_worker.faults import maybe_inject
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo, broadcast_bytes, destroy_process_group, init_process_group
from shm_ipc import ChannelHandle, Command, OwnerDiedError, PlanReceiver
from shm_ipc.errors import ChannelClosed

logger = logging.getLogger(__name__)

# Exit codes of a worker process.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_OWNER_DIED = 3


@dataclass(frozen=True)
class Bootstrap:
    """Everything a worker needs from rank 0 before its first step."""

    model_dir: str
    runner_config: RunnerConfig
    channel: ChannelHandle

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "model_dir": self.model_dir,
                "runner_config": self.runner_config.to_dict(),
                "channel": self.channel.to_bytes(),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Bootstrap:
        fields = msgpack.unpackb(data)
        return cls(
            model_dir=fields["model_dir"],
            runner_config=RunnerConfig.from_dict(fields["runner_config"]),
            channel=ChannelHandle.from_bytes(fields["channel"]),
        )


def default_device(tp: TPInfo) -> torch.device:
    """This rank's device: its local GPU when the group runs NCCL, else the CPU."""
    import torch.distributed as dist

    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", tp.rank)) % torch.cuda.device_count()
        )
    return torch.device("cpu")


def run_worker(tp: TPInfo, device: torch.device | None = None) -> int:
    """Serve rank 0 until it sends EXIT; returns the process exit code."""
    from rank_worker.model_runner import ModelRunner  # deferred: pulls in the model code

    if tp.is_first:
        raise ValueError("run_worker is for ranks 1..N-1; rank 0 runs the engine")
    boot = Bootstrap.from_bytes(broadcast_bytes(None, tp))
    device = device or default_device(tp)
    receiver = PlanReceiver(boot.channel, tp.rank)
    step_id: int | None = None
    try:
        runner = ModelRunner(boot.model_dir, boot.runner_config, tp, device)
        runner.init_kv_cache(runner.determine_num_kv_blocks())
        while True:
            plan = receiver.recv()
            step_id = plan.step_id
            if plan.command == Command.EXIT:
                return EXIT_OK
            maybe_inject(tp.rank, plan.step_id)
            runner.execute(plan)
    except (OwnerDiedError, ChannelClosed) as exc:
        logger.error("rank %d: %s", tp.rank, exc)
        return EXIT_OWNER_DIED
    except BaseException as exc:
        # Tell rank 0 what happened before the process group notices this rank is gone.
        receiver.report_error(step_id, exc)
        logger.exception("rank %d failed at step %s", tp.rank, step_id)
        return EXIT_FAILED
    finally:
        receiver.close()


def main() -> int:
    """Entry point of a worker process started by `LLM` (env: RANK, WORLD_SIZE, MASTER_*)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(int(os.environ.get("TP_ENGINE_WORKER_THREADS", torch.get_num_threads())))
    tp = init_process_group(os.environ.get("TP_ENGINE_DIST_BACKEND") or None)
    try:
        return run_worker(tp)
    finally:
        destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
