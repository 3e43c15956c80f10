"""The messages of prefill/decode disaggregation (`--disaggregation-mode`), on their hops:

    hop                                              messages
    a rank's KV agent -> its server's rank 0         RankHello, RankDone
    a prefill's rank 0 -> one of its ranks' agent    SendOrder, StopAgent
    a decode's rank 0 -> the prefill's rank 0        KVRequest (pages, once per request)
    the prefill's rank 0 -> the decode's rank 0      KVStatus (the first token, or why not)

The KV itself moves between the ranks' registered memory (Mooncake's transfer engine,
`rank_worker.kv.kv_transfer`), never in these messages. Every hop is ZeroMQ PUSH/PULL with these
msgspec structs (`wire`), so nothing unpickles a peer's bytes; a message of another version is
refused by name (`decode_pd`).
"""

from __future__ import annotations

from typing import Any

from shm_ipc import wire

__all__ = [
    "KVRequest",
    "KVStatus",
    "PDMessage",
    "PDWireError",
    "RankDone",
    "RankHello",
    "Region",
    "SendOrder",
    "StopAgent",
    "decode_pd",
]


class PDWireError(ValueError):
    """A peer sent something that is not one of these messages."""


class Region(wire.Record, frozen=True):
    """Where one rank's paged KV cache lies in its process's memory (`kv_transfer.KVRegion`)."""

    base_ptr: int
    num_layers: int
    layer_stride: int
    kv_stride: int
    block_bytes: int
    num_blocks: int


class RankHello(wire.Message, frozen=True):
    """A rank's agent is up: its transfer engine's session ("host:port"), its registered cache
    (or, `staged`, the host staging pool it registered instead: `rank_worker.kv.pd_staging`),
    and (prefill) where it takes orders."""

    rank: int
    session: str
    region: Region
    orders: str | None = None
    staged: bool = False


class RankDone(wire.Message, frozen=True):
    """A prefill rank wrote (or failed to write) its shard of a room's pages."""

    room: int
    rank: int
    error: str | None
    num_bytes: int
    seconds: float


class PeerRank(wire.Record, frozen=True):
    """One decode rank as a prefill rank writes into it."""

    session: str
    region: Region


class SendOrder(wire.Message, frozen=True):
    """Prefill rank 0 to one of its ranks: write these blocks of yours into the peer's."""

    room: int
    src_blocks: list[int]
    dst_blocks: list[int]
    peer: PeerRank


class StopAgent(wire.Message, frozen=True):
    """The server is shutting down: the agent's thread ends."""


class KVRequest(wire.Message, frozen=True):
    """A decode's rank 0 to the prefill's: the pages it allocated for room `room`'s prompt
    (`num_tokens` tokens), its ranks (one per prefill rank: equal tensor-parallel sizes), and
    where to send the `KVStatus`."""

    room: int
    num_tokens: int
    blocks: list[int]
    ranks: list[PeerRank]
    status_to: str


class KVStatus(wire.Message, frozen=True):
    """The prefill's rank 0 to the decode's: room `room`'s pages are written (`error` None)
    and its first token, sampled on the prefill, with its logprob entry when one was asked
    for (`[token ids], [logprobs], rank`); or why not."""

    room: int
    error: str | None
    token: int = -1
    logprobs: tuple[list[int], list[float], int] | None = None


PDMessage = RankHello | RankDone | SendOrder | StopAgent | KVRequest | KVStatus
_DECODER = wire.decoder(PDMessage)


def decode_pd(data: Any, what: str) -> PDMessage:
    """One message of these hops; PDWireError naming `what` (the peer) otherwise."""
    return wire.decode(_DECODER, data, PDWireError, what)
