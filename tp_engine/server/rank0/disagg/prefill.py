"""A prefill server's rooms: each request the router paired with a decode (`bootstrap_room`)
is computed here for one token, its blocks kept, and written into the decode's pages once the
decode has said where they are.

Room states (by `bootstrap_room`; either half may come first):

    the request arrives ──► computing (max_tokens 1) ──► computed: its blocks kept and its
                                                         answer (one Delta) held back
    the decode's KVRequest arrives ──► asked
    computed and asked ──► writing: one SendOrder per rank ──► every RankDone ──► done: the
        blocks go back, the decode gets KVStatus (the first token, or the error), and the
        request's answer is sent (an error, 500, when the write failed)

A room the decode never asks for within `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, and a
KVRequest whose request never comes in that time, are dropped: the blocks go back, the
request fails (the decode's side ends on its own timeout, or on the failed status). A request
aborted while computing frees its blocks as any other; its room, if asked, gets a failed status.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from shm_ipc.pd_wire import KVRequest, KVStatus, RankDone, RankHello, SendOrder, decode_pd
from tp_engine.core.outputs import SequenceOutput
from tp_engine.server.disagg_flags import DisaggregationOptions
from tp_engine.server.messages import AddRequest
from tp_engine.server.rank0.disagg.agents import AgentHub, Pushes
from tp_engine.server.rank0.disagg.bootstrap import BootstrapServer

logger = logging.getLogger(__name__)

__all__ = ["PrefillRooms"]


@dataclass
class _Room:
    room: int
    seq_id: str | None = None
    asked: KVRequest | None = None
    # The finished output of its one token, held until the write is done.
    output: SequenceOutput | None = None
    blocks: list[int] | None = None
    dones: dict[int, RankDone] = field(default_factory=dict)
    writing: bool = False
    deadline: float = 0.0


class PrefillRooms:
    """See the module docstring. `engine`: the `LLMEngine`; `facts`: what the bootstrap
    server says of this server besides its ranks (page size, KV dtype, model...)."""

    def __init__(
        self,
        engine: Any,
        options: DisaggregationOptions,
        hub: AgentHub,
        bind_host: str,
        facts: dict[str, Any],
    ) -> None:
        self.engine = engine
        self.options = options
        self.hub = hub
        self.tp_size = engine.config.tensor_parallel_size
        ctx = zmq.Context.instance()
        self._requests = ctx.socket(zmq.PULL)
        self._requests.setsockopt(zmq.LINGER, 0)
        port = self._requests.bind_to_random_port(f"tcp://{hub.host}")
        self.endpoint = f"tcp://{hub.host}:{port}"
        self._status = Pushes()
        self._rooms: dict[int, _Room] = {}
        self._by_seq: dict[str, _Room] = {}
        self.bootstrap = BootstrapServer(bind_host, options.bootstrap_port)
        self._facts = facts

    def start(self, hellos: list[RankHello]) -> None:
        """Every rank's agent reported: the bootstrap server answers from now on."""
        ranks = [_rank_entry(self.hub.host, hello) for hello in hellos]
        info = {
            **self._facts, "attn_tp_size": self.tp_size, "attn_cp_size": 1, "dp_size": 1,
            "pp_size": 1, "kv_requests": self.endpoint, "follow_bootstrap_room": True,
        }  # fmt: skip
        self.bootstrap.ready(info, ranks)
        logger.info(
            "prefill: bootstrap server on port %d, KV requests on %s",
            self.bootstrap.port,
            self.endpoint,
        )

    # -- requests ---------------------------------------------------------------------------

    def params(self, msg: AddRequest) -> dict[str, Any]:
        """The request's sampling fields as the prefill runs them: one token (which honours
        `min_tokens` as the first of the decode's would)."""
        fields = dict(msg.sampling_params)
        fields["max_tokens"] = 1
        fields["min_tokens"] = min(int(fields.get("min_tokens") or 0), 1)
        return fields

    def in_use(self, room_id: int) -> bool:
        """Whether a request holds room `room_id` already (a decode's ask alone does not)."""
        room = self._rooms.get(room_id)
        return room is not None and room.seq_id is not None

    def added(self, msg: AddRequest, seq_id: str) -> None:
        assert msg.bootstrap is not None
        room = self._room(msg.bootstrap.room)
        room.seq_id = seq_id
        self._by_seq[seq_id] = room

    def holds(self, out: SequenceOutput) -> bool:
        """Whether the engine loop must hold `out` back (a paired request's final output,
        until its pages are written); takes what the room needs of it."""
        room = self._by_seq.get(out.seq_id)
        if room is None or not out.finished:
            return False
        room.output = out
        kept = self.engine.core.scheduler.allocation.kept.get(out.seq_id)
        room.blocks = None if kept is None else list(kept.block_table)
        if room.blocks is None:  # aborted: nothing is kept, nothing can be sent
            self._finish(room, f"the prefill's request ended ({out.finish_reason}) before its "
                         "pages were written")  # fmt: skip
            return False
        room.deadline = time.monotonic() + self.options.bootstrap_timeout_s
        self._maybe_write(room)
        return True

    def aborted(self, seq_id: str) -> None:
        """The client left (the router gave up on the pair): while its request computed, its
        blocks were freed with it; once computed and not yet being written, its kept blocks go
        back now, not after the bootstrap timeout. A write under way runs to its end (the
        ranks read those blocks), and its answer goes nowhere."""
        room = self._by_seq.get(seq_id)
        if room is None or room.writing:
            return
        if room.output is None:
            room.seq_id = None  # nothing kept to give back
            self._by_seq.pop(seq_id)
        self._finish(room, "the prefill's request was aborted")

    def poll(self) -> list[tuple[SequenceOutput, str | None]]:
        """Take the decodes' requests and the ranks' answers; end timed-out rooms. Returns the
        outputs released (their requests answered) and, for each, why it failed (None: it
        did not)."""
        released: list[tuple[SequenceOutput, str | None]] = []
        while self._requests.poll(0):
            try:
                ask = decode_pd(self._requests.recv(), "a decode server's KVRequest")
            except ValueError as exc:
                logger.warning("prefill: %s", exc)
                continue
            if isinstance(ask, KVRequest):
                room = self._room(ask.room)
                room.asked = ask
                self._maybe_write(room)
        for done in self.hub.take_dones():
            room = self._rooms.get(done.room)
            if room is None:
                continue
            room.dones[done.rank] = done
            if len(room.dones) == self.tp_size:
                errors = [d.error for d in room.dones.values() if d.error]
                released += self._finish(room, errors[0] if errors else None)
        now = time.monotonic()
        for room in list(self._rooms.values()):
            computing = room.seq_id is not None and room.output is None
            if not (room.writing or computing) and now > room.deadline:
                why = (
                    "no decode asked for its pages" if room.asked is None
                    else "its request never reached this prefill"
                )  # fmt: skip
                released += self._finish(
                    room, f"room {room.room}: {why} within {self.options.bootstrap_timeout_s:g} s"
                )
        return released

    @property
    def busy(self) -> bool:
        return bool(self._rooms)

    def _room(self, room_id: int) -> _Room:
        room = self._rooms.get(room_id)
        if room is None:
            deadline = time.monotonic() + self.options.bootstrap_timeout_s
            room = self._rooms[room_id] = _Room(room_id, deadline=deadline)
        return room

    def _maybe_write(self, room: _Room) -> None:
        ask, blocks = room.asked, room.blocks
        if ask is None or blocks is None or room.output is None or room.writing:
            return
        prompt = self._prompt_len(room)
        needed = len(ask.blocks)
        why = None
        if ask.num_tokens != prompt:
            why = (f"the decode's prompt has {ask.num_tokens} tokens, this prefill's {prompt} "
                   "(do both servers use the same tokenizer and chat template?)")  # fmt: skip
        elif len(ask.ranks) != self.tp_size:
            why = f"the decode has {len(ask.ranks)} ranks, this prefill {self.tp_size}"
        elif needed > len(blocks):
            why = f"the decode asks for {needed} pages of a {len(blocks)}-page prompt"
        if why is not None:
            self._finish(room, why)
            return
        room.writing = True
        for rank in range(self.tp_size):
            self.hub.order(rank, SendOrder(room.room, blocks[:needed], ask.blocks, ask.ranks[rank]))

    def _prompt_len(self, room: _Room) -> int:
        kept = self.engine.core.scheduler.allocation.kept.get(room.seq_id)
        return 0 if kept is None else kept.num_prompt_tokens

    def _finish(self, room: _Room, error: str | None) -> list[tuple[SequenceOutput, str | None]]:
        """End a room: blocks back, the decode told, the request answered."""
        self._rooms.pop(room.room, None)
        if room.seq_id is not None:
            self._by_seq.pop(room.seq_id, None)
            self.engine.core.scheduler.allocation.release_kept(room.seq_id)
        out = room.output
        if room.asked is not None:
            status = KVStatus(room.room, error)
            if error is None and out is not None and out.new_token_ids:
                lp = out.new_logprobs[0] if out.new_logprobs else None
                entry = None if lp is None else (lp.token_ids, lp.logprobs, lp.rank)
                status = KVStatus(room.room, None, out.new_token_ids[0], entry)
            elif error is None:
                status = KVStatus(room.room, "the prefill sampled no token")
            self._status.send(room.asked.status_to, status)
        if error is not None:
            logger.warning("prefill: room %d failed: %s", room.room, error)
        if out is None:
            return []
        return [(dataclasses.replace(out, finish_reason="abort") if error else out, error)]

    def close(self) -> None:
        self.bootstrap.close()
        self._status.close()
        self._requests.close(linger=0)


def _rank_entry(host: str, hello: RankHello) -> dict[str, Any]:
    """One rank in the bootstrap server's answer (SGLang's `rank_ip`, `rank_port`)."""
    port = int(hello.orders.rsplit(":", 1)[1]) if hello.orders else 0
    return {
        "rank_ip": host,
        "rank_port": port,
        "session": hello.session,
        "block_bytes": hello.region.block_bytes,
        "num_layers": hello.region.num_layers,
    }
