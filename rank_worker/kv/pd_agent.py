"""One rank's end of prefill/decode disaggregation: its KV cache registered with Mooncake's
transfer engine and, on a prefill server, a thread that writes pages into decode servers.

Both roles: at start-up (after the cache is allocated) the agent registers the cache's one
allocation, and tells its server's rank 0 (`RankHello`, over ZeroMQ to the address in
`RunnerConfig.disaggregation`) its engine's session and where the cache lies. A decode rank has
nothing more to do: the prefill's ranks write straight into its memory, and its rank 0 learns
from the prefill's rank 0 when a request's pages are complete.

Prefill: rank 0 orders each write once the decode has said where the pages go and the prompt's
step has run (`SendOrder`: this rank's blocks → the decode rank's blocks); the agent's thread
writes its shard (this rank's KV heads; equal tensor-parallel sizes pair rank r with rank r),
layer by layer and run by run (`kv_transfer.write_descriptors`), and answers `RankDone`. The
writes run off the step thread; the blocks they read are held by rank 0 until every rank has
answered, so no later step overwrites them meanwhile. On a GPU the thread first waits for the
device's queued work (the forward pass that filled those blocks was queued before the order
was given).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec
import torch
import zmq

from rank_worker.kv.kv_transfer import KVRegion, KVTransferEngine
from shm_ipc import wire
from shm_ipc.pd_wire import RankDone, RankHello, Region, SendOrder, StopAgent, decode_pd

logger = logging.getLogger(__name__)

__all__ = ["KVAgent", "region_of", "start_kv_agent"]


def region_of(region: KVRegion) -> Region:
    return Region(**region.to_wire())


def kv_region(region: Region) -> KVRegion:
    return KVRegion.from_wire(msgspec.structs.asdict(region))


class KVAgent:
    """See the module docstring. `settings`: `RunnerConfig.disaggregation` (mode, host,
    endpoint: rank 0's address for the agents, ib_device)."""

    def __init__(self, storage: torch.Tensor, rank: int, settings: dict[str, Any]) -> None:
        self.mode = settings["mode"]
        self.rank = rank
        self.device = storage.device
        self.engine = KVTransferEngine(settings["host"], device_name=settings.get("ib_device", ""))
        self.engine.register(storage)
        self.region = KVRegion.of_cache(storage)
        self._endpoint = settings["endpoint"]
        self._ctx = zmq.Context.instance()
        self._thread: threading.Thread | None = None
        if self.mode == "prefill":
            self._orders = self._ctx.socket(zmq.PULL)
            self._orders.setsockopt(zmq.LINGER, 0)
            port = self._orders.bind_to_random_port(f"tcp://{settings['host']}")
            orders = self._orders_address = f"tcp://{settings['host']}:{port}"
            self._thread = threading.Thread(
                target=self._serve, args=(orders,), name=f"kv-agent-{rank}", daemon=True
            )
            self._thread.start()
        else:
            push = self._push()
            push.send(wire.encode(self._hello(None)))
            push.close(linger=2000)

    def _hello(self, orders: str | None) -> RankHello:
        return RankHello(self.rank, self.engine.session_id, region_of(self.region), orders)

    def _push(self) -> zmq.Socket:
        push = self._ctx.socket(zmq.PUSH)
        push.connect(self._endpoint)
        return push

    def _serve(self, orders: str) -> None:
        push = self._push()  # this thread's own socket (ZeroMQ sockets are not thread-safe)
        push.send(wire.encode(self._hello(orders)))
        while True:
            msg = decode_pd(self._orders.recv(), f"rank 0's orders to rank {self.rank}")
            if isinstance(msg, StopAgent):
                break
            if isinstance(msg, SendOrder):
                push.send(wire.encode(self._write(msg)))
        push.close(linger=1000)

    def _write(self, order: SendOrder) -> RankDone:
        start = time.perf_counter()
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            moved = self.engine.write_blocks(
                order.peer.session,
                self.region,
                kv_region(order.peer.region),
                order.src_blocks,
                order.dst_blocks,
            )
        except Exception as exc:  # the peer is gone, a mismatch: rank 0 fails that request alone
            logger.warning("rank %d: room %d's pages: %s", self.rank, order.room, exc)
            return RankDone(order.room, self.rank, f"rank {self.rank}: {exc}", 0, 0.0)
        return RankDone(order.room, self.rank, None, moved, time.perf_counter() - start)

    def close(self) -> None:
        if self._thread is not None:
            stop = self._ctx.socket(zmq.PUSH)
            stop.connect(self._orders_address)  # a message to ourselves ends the thread's recv
            stop.send(wire.encode(StopAgent()))
            self._thread.join(timeout=5.0)
            stop.close(linger=0)
            self._orders.close(linger=0)
            self._thread = None
        self.engine.close()


def start_kv_agent(kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None, rank: int,
                   settings: dict[str, Any] | None) -> KVAgent | None:  # fmt: skip
    """The rank's agent when its server disaggregates (`settings` set), else None. `kv_caches`:
    the runner's per-layer views of one allocation (`rank_worker.kv.cache.allocate_kv_cache`)."""
    if not settings:
        return None
    if not kv_caches:
        raise RuntimeError("the KV agent needs the allocated cache (init_kv_cache first)")
    storage = kv_caches[0][0]._base
    if storage is None or storage.dim() != 6:
        raise RuntimeError("the KV cache is not one [layers, 2, blocks, ...] allocation")
    return KVAgent(storage, rank, settings)
