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
from typing import Any

from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo, broadcast_bytes
from shm_ipc import ChannelHandle, wire


@dataclass(frozen=True)
class Bootstrap:
    """Everything a worker needs from rank 0 before its first step (`_BootstrapFrame` on the
    wire: `shm_ipc.wire`'s codec, msgpack, never pickle)."""

    model_dir: str
    runner_config: RunnerConfig
    channel: ChannelHandle

    def to_bytes(self) -> bytes:
        return wire.encode(
            _BootstrapFrame(self.model_dir, self.runner_config.to_dict(), self.channel)
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Bootstrap:
        frame = wire.decode(_DECODER, data, ValueError, "not a worker's bootstrap")
        # RunnerConfig.from_dict refuses a field this build does not know (a version mismatch).
        return cls(frame.model_dir, RunnerConfig.from_dict(frame.runner_config), frame.channel)

    def send(self, tp: TPInfo) -> None:
        """Rank 0: broadcast this to every worker (a collective)."""
        broadcast_bytes(self.to_bytes(), tp)

    @classmethod
    def receive(cls, tp: TPInfo) -> Bootstrap:
        """A worker: the Bootstrap rank 0 sends (a collective)."""
        return cls.from_bytes(broadcast_bytes(None, tp))


class _BootstrapFrame(wire.Record, frozen=True):
    """A Bootstrap as it travels: the config by its field names, the handle as its record."""

    model_dir: str
    runner_config: dict[str, Any]
    channel: ChannelHandle


_DECODER = wire.decoder(_BootstrapFrame)
