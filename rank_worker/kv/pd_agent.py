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

Where the cache itself cannot be registered, the agent registers a host staging pool instead
and says so in its hello (`rank_worker.kv.pd_staging`): a prefill's writes then go through it,
and a decode's pages land in it and are copied into the cache by the step plans.
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
from rank_worker.kv.pd_staging import HostStaging, StagingCopier, staging_reason, staging_slots
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
    endpoint: rank 0's address for the agents, ib_device, host_staging); `staging_tokens`: the
    staging pool's size, where there is one."""

    def __init__(
        self, storage: torch.Tensor, rank: int, settings: dict[str, Any], staging_tokens: int
    ) -> None:
        self.mode = settings["mode"]
        self.rank = rank
        self.device = storage.device
        self.engine = KVTransferEngine(settings["host"], device_name=settings.get("ib_device", ""))
        setting = settings.get("host_staging", "auto")
        why = staging_reason(setting, storage)
        if why is None:
            try:
                self.engine.register(storage)
            except RuntimeError as exc:
                if setting != "auto":
                    raise
                why = f"registering the device cache failed ({exc})"
        self.staging: HostStaging | None = None
        if why is not None:
            slots = staging_slots(staging_tokens, storage)
            self.staging = HostStaging(storage, slots)
            self.engine.register(self.staging.pool)
            logger.info("rank %d: KV through a host staging pool of %d blocks: %s",
                        rank, slots, why)  # fmt: skip
        self.region = KVRegion.of_cache(storage if self.staging is None else self.staging.pool)
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
        staged = self.staging is not None
        return RankHello(self.rank, self.engine.session_id, region_of(self.region), orders, staged)

    def plan_copier(self, runner: Any) -> StagingCopier | None:
        """A decode rank's copier of its staged pages into `runner`'s cache (None: the pages
        land in the cache itself)."""
        if self.staging is None or self.mode != "decode":
            return None
        return StagingCopier(self.staging, runner.kv_caches, runner.host_pool)

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
            peer = order.peer.session, kv_region(order.peer.region)
            if self.staging is not None:
                moved = self.staging.send(self.engine, *peer, order.src_blocks, order.dst_blocks)
            else:
                moved = self.engine.write_blocks(
                    peer[0], self.region, peer[1], order.src_blocks, order.dst_blocks
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


def start_kv_agent(runner: Any, rank: int) -> KVAgent | None:
    """The rank's agent when its server disaggregates (`runner.config.disaggregation` set),
    else None; a decode's staging copier goes in `runner.kv_staging`. `runner.kv_caches`: the
    per-layer views of one allocation (`rank_worker.kv.cache.allocate_kv_cache`)."""
    settings = runner.config.disaggregation
    if not settings:
        return None
    kv_caches = runner.kv_caches
    if not kv_caches:
        raise RuntimeError("the KV agent needs the allocated cache (init_kv_cache first)")
    storage = kv_caches[0][0]._base
    if storage is None or storage.dim() != 6:
        raise RuntimeError("the KV cache is not one [layers, 2, blocks, ...] allocation")
    # By default a staging pool holds two of the longest prompts.
    tokens = int(settings.get("staging_tokens") or 2 * runner.config.max_model_len)
    agent = KVAgent(storage, rank, settings, tokens)
    runner.kv_staging = agent.plan_copier(runner)
    return agent
