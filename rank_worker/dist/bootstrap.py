"""What rank 0 tells every worker once, before the first step.

Start-up, in the same order on every rank (rank 0's side is `tp_engine.engine.LLMEngine`, the
workers' `rank_worker.dist.worker.run_worker`):

1. the process group is up (`rank_worker.dist.bringup`);
2. rank 0 broadcasts a `Bootstrap` (checkpoint, `RunnerConfig`, channel handle) as bytes;
3. each worker attaches a `PlanReceiver`, which says hello to rank 0;
4. every rank loads its weight shard and agrees on the number of KV blocks (a collective);
5. every rank runs the same plans, one step after another (`rank_worker.dist.step`), until EXIT.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo, broadcast_bytes
from shm_ipc import ChannelHandle


@dataclass(frozen=True)
class Bootstrap:
    """Everything a worker needs from rank 0 before its first step (msgpack, never pickle)."""

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

    def send(self, tp: TPInfo) -> None:
        """Rank 0: broadcast this to every worker (a collective)."""
        broadcast_bytes(self.to_bytes(), tp)

    @classmethod
    def receive(cls, tp: TPInfo) -> Bootstrap:
        """A worker: the Bootstrap rank 0 sends (a collective)."""
        return cls.from_bytes(broadcast_bytes(None, tp))
