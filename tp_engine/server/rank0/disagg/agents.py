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

__all__ = ["AgentHub"]


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
        self._orders: dict[int, zmq.Socket] = {}
        self._dones: list[RankDone] = []

    def settings(self, mode: str, ib_device: str) -> dict[str, str]:
        """What each rank's agent is told (`RunnerConfig.disaggregation`)."""
        return {"mode": mode, "host": self.host, "endpoint": self.endpoint, "ib_device": ib_device}

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
        sock = self._orders.get(rank)
        if sock is None:
            orders = self.hellos[rank].orders
            assert orders is not None, f"rank {rank}'s agent takes no orders (a decode's)"
            sock = self._orders[rank] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(orders)
        sock.send(wire.encode(order))

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
        for sock in self._orders.values():
            sock.close(linger=0)
        self._pull.close(linger=0)
