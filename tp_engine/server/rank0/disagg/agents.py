"""Rank 0's end of its ranks' KV agents (`rank_worker.kv.pd_agent`): one ZeroMQ PULL where every
agent says hello (its transfer engine's session and where its cache lies) and, on a prefill,
answers each write order; and the PUSH sockets rank 0 orders writes on.

The address is bound before the engine starts, so that it travels to the ranks in their
`RunnerConfig.disaggregation`; the hellos arrive once each rank has allocated its cache.
"""

from __future__ import annotations

import time

import zmq

from shm_ipc import wire
from shm_ipc.pd_wire import RankDone, RankHello, SendOrder, decode_pd
from tp_engine.server.disagg_flags import DisaggregationOptions

__all__ = ["AgentHub", "Pushes"]


class Pushes:
    """ZeroMQ PUSH sockets by the address they send to, made on first use (a rank's orders,
    a peer server's requests or statuses); never blocking on a slow peer's queue."""

    def __init__(self) -> None:
        self._socks: dict[str, zmq.Socket] = {}

    def send(self, to: str, msg: object) -> None:
        sock = self._socks.get(to)
        if sock is None:
            sock = self._socks[to] = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(to)
        sock.send(wire.encode(msg))

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()


class AgentHub:
    """See the module docstring; `host`: the address this node's transfer engines and
    sockets use."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}"
        self.hellos: dict[int, RankHello] = {}
        self._orders = Pushes()
        self._dones: list[RankDone] = []

    def settings(self, options: DisaggregationOptions) -> dict[str, str]:
        """What each rank's agent is told (`RunnerConfig.disaggregation`)."""
        return {
            "mode": options.mode, "host": self.host, "endpoint": self.endpoint,
            "ib_device": options.ib_device, "host_staging": options.host_staging,
            "staging_tokens": str(options.staging_tokens),
        }  # fmt: skip

    def wait_for_ranks(self, world_size: int, timeout_s: float) -> list[RankHello]:
        """Every rank's hello, by rank (RuntimeError naming the missing after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while len(self.hellos) < world_size:
            left = deadline - time.monotonic()
            if left <= 0 or not self._pull.poll(int(left * 1000)):
                missing = sorted(set(range(world_size)) - set(self.hellos))
                raise RuntimeError(f"the KV agents of ranks {missing} never reported")
            self._take(self._pull.recv())
        return [self.hellos[r] for r in range(world_size)]

    def order(self, rank: int, order: SendOrder) -> None:
        orders = self.hellos[rank].orders
        assert orders is not None, f"rank {rank}'s agent takes no orders (a decode's)"
        self._orders.send(orders, order)

    def take_dones(self) -> list[RankDone]:
        """The write answers that arrived (never blocks)."""
        while self._pull.poll(0):
            self._take(self._pull.recv())
        dones, self._dones = self._dones, []
        return dones

    def _take(self, data: bytes) -> None:
        msg = decode_pd(data, "a KV agent")
        if isinstance(msg, RankHello):
            self.hellos[msg.rank] = msg
        elif isinstance(msg, RankDone):
            self._dones.append(msg)

    def close(self) -> None:
        self._orders.close()
        self._pull.close(linger=0)
