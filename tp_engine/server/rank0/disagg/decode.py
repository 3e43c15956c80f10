"""A decode server's rooms: each request the router paired with a prefill waits outside the
batch (`tp_engine.core.remote_prompts`) until the prefill's ranks have written its prompt's
K/V into the blocks taken for it, then joins the batch with the prefill's first token.

Per request (by `bootstrap_room`):

    added (held) ──► the prefill's facts known (GET /route once per prefill, on a thread:
        a bogus or unreachable host fails its requests within the timeout, never the loop)
        ──► blocks free: taken, KVRequest(room, blocks, this server's ranks) sent
        ──► KVStatus: the first token → the batch; an error → the request fails (500)
    no KVStatus within SGLANG_DISAGGREGATION_WAITING_TIMEOUT: fails, blocks freed; an abort
    (the client left, the router gave up) frees them at once.

Where the ranks registered host staging pools instead of their caches
(`--disaggregation-host-staging`), the prefill writes into staging slots (`staging`), and the
pages reach the request's blocks by a copy in the next step plan once the status has come.

A prefill is refused, for all its requests, when its facts differ from this server's (page
size, KV dtype, tensor-parallel size, layers, bytes per block): the message names both sides.
With `--disaggregation-transfer-backend fake` (or SGLang's fake bootstrap host 2.2.2.2, its
warm-up and health requests) nothing moves: the blocks are left as they are and the first
token is made up from the request id, SGLang's way (a decode benchmark's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from shm_ipc.block_copies import DEVICE_TIER, STAGING_TIER, BlockCopy
from shm_ipc.pd_wire import KVRequest, KVStatus, PeerRank, RankHello, decode_pd
from tp_engine.core.outputs import SequenceOutput
from tp_engine.core.sequence import SequenceStatus, TokenLogprobs
from tp_engine.server.disagg_flags import DisaggregationOptions
from tp_engine.server.messages import AddRequest, Bootstrap
from tp_engine.server.rank0.disagg.agents import AgentHub, Pushes
from tp_engine.server.rank0.disagg.staging import StagingSlots

logger = logging.getLogger(__name__)

__all__ = ["FAKE_BOOTSTRAP_HOST", "DecodeRooms"]

# SGLang's bootstrap host of its warm-up and /health_generate requests: nothing to fetch.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
# How long one GET of a prefill's facts may take.
_FETCH_TIMEOUT_S = 10.0


@dataclass
class _Room:
    room: int
    seq_id: str
    peer: tuple[str, int] | None  # None: fake
    deadline: float
    asked: bool = False
    slots: list[int] | None = None  # where the prefill writes, with host staging


class DecodeRooms:
    """See the module docstring. `facts`: this server's (what a prefill must match)."""

    def __init__(
        self, engine: Any, options: DisaggregationOptions, hub: AgentHub, facts: dict[str, Any]
    ) -> None:
        self.engine = engine
        self.options = options
        self.hub = hub
        self.facts = facts
        ctx = zmq.Context.instance()
        self._status = ctx.socket(zmq.PULL)
        self._status.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{hub.host}:{self._status.bind_to_random_port(f'tcp://{hub.host}')}"
        self._ranks: list[PeerRank] = []
        self._slots: StagingSlots | None = None
        self._peers: dict[tuple[str, int], Future[dict[str, Any]]] = {}
        self._pushes = Pushes()
        self._rooms: dict[int, _Room] = {}
        self._by_seq: dict[str, _Room] = {}
        self._fetcher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pd-bootstrap")
        # The heartbeats to the prefills rooms wait on: one check in flight per prefill, its
        # misses in a row, and when the next is due.
        self._beats: dict[tuple[str, int], Future[bool]] = {}
        self._misses: dict[tuple[str, int], int] = {}
        self._next_beat: dict[tuple[str, int], float] = {}

    def start(self, hellos: list[RankHello]) -> None:
        self._ranks = [PeerRank(h.session, h.region) for h in hellos]
        staged = [h.rank for h in hellos if h.staged]
        if staged and len(staged) != len(hellos):
            raise RuntimeError(
                f"ranks {staged} stage KV pages through host memory, the others register "
                "their caches: every rank must do the same (--disaggregation-host-staging)"
            )
        self._slots = StagingSlots(hellos[0].region.num_blocks) if staged else None
        logger.info("decode: KV statuses on %s", self.endpoint)

    # -- requests ---------------------------------------------------------------------------

    def added(self, msg: AddRequest, seq_id: str) -> None:
        boot = msg.bootstrap
        assert boot is not None
        peer = (
            None if self._is_fake(boot) else (boot.host, boot.port or self.options.bootstrap_port)
        )
        room = _Room(boot.room, seq_id, peer, time.monotonic() + self.options.waiting_timeout_s)
        self._rooms[boot.room] = room
        self._by_seq[seq_id] = room
        if peer is not None and peer not in self._peers:
            self._fetch(peer)

    def _fetch(self, peer: tuple[str, int]) -> Future[dict[str, Any]]:
        """Ask `peer`'s bootstrap server for its facts, on a thread, within half a request's
        own wait (so that its error says why)."""
        timeout_s = min(_FETCH_TIMEOUT_S, self.options.waiting_timeout_s / 2)
        self._peers[peer] = self._fetcher.submit(_fetch_facts, *peer, timeout_s)
        return self._peers[peer]

    def in_use(self, room_id: int) -> bool:
        return room_id in self._rooms

    def _is_fake(self, boot: Bootstrap) -> bool:
        return self.options.backend == "fake" or boot.host == FAKE_BOOTSTRAP_HOST

    def aborted(self, seq_id: str) -> None:
        room = self._by_seq.get(seq_id)
        if room is not None:
            self._forget(room)

    @property
    def busy(self) -> bool:
        return bool(self._rooms)

    def poll(self) -> list[tuple[SequenceOutput, str | None]]:
        """Ask for pages, take statuses, end the timed out: the outputs to send (a first token,
        or a failure and why)."""
        outs = self._check_heartbeats()
        failed: set[tuple[str, int]] = set()  # prefills whose facts could not be had
        remote = self.engine.core.intake.remote
        if self._slots is not None:
            self._slots.steps_applied(self.engine.core.pipeline.applied_step_id)
        for seq in remote.reserve():
            room = self._by_seq.get(seq.seq_id)
            if room is not None and room.peer is None:  # fake: nothing moves
                outs += self._arrive(room, _made_up_token(seq.seq_id, self.engine.vocab_size))
        for room in list(self._rooms.values()):
            if room.asked or room.peer is None:
                continue
            seq = remote.reserved(room.seq_id)
            if seq is None:
                continue  # still waiting for blocks
            facts = self._peers.get(room.peer)
            if facts is None:  # its earlier fetch failed: try again for this one
                facts = self._fetch(room.peer)
            if not facts.done():
                continue
            why = self._mismatch(room.peer, facts)
            if why is not None:
                if facts.exception() is not None:
                    failed.add(room.peer)
                outs += self._fail(room, why)
                continue
            blocks = self._staging_slots(room, len(seq.block_table), seq.block_table)
            if blocks is None:
                continue  # waiting for staging slots
            if not blocks:
                outs += self._fail(room, self._too_long(len(seq.block_table)))
                continue
            self._ask(room, facts.result(), seq.num_prompt_tokens, blocks)
        for peer in failed:
            self._peers.pop(peer, None)
        while self._status.poll(0):
            try:
                status = decode_pd(self._status.recv(), "a prefill server's KVStatus")
            except ValueError as exc:
                logger.warning("decode: %s", exc)
                continue
            room = self._rooms.get(status.room) if isinstance(status, KVStatus) else None
            if room is None:
                continue  # aborted or timed out meanwhile
            assert isinstance(status, KVStatus)
            if status.error is not None:
                outs += self._fail(room, f"the prefill failed: {status.error}")
            else:
                lp = None if status.logprobs is None else TokenLogprobs(*status.logprobs)
                outs += self._arrive(room, status.token, lp)
        now = time.monotonic()
        for room in list(self._rooms.values()):
            if now > room.deadline:
                where = "" if room.peer is None else f" from {room.peer[0]}:{room.peer[1]}"
                outs += self._fail(
                    room,
                    f"its KV pages{where} did not arrive within "
                    f"{self.options.waiting_timeout_s:g} s (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)",
                )
        return outs

    def _check_heartbeats(self) -> list[tuple[SequenceOutput, str | None]]:
        """SGLang's heartbeat: each prefill some room waits on is asked for its bootstrap
        server's /health every `heartbeat_interval_s`; after `heartbeat_failures` failures in
        a row its rooms fail at once (a dead prefill, long before the waiting timeout), and its
        facts are fetched again for the next request."""
        outs: list[tuple[SequenceOutput, str | None]] = []
        now = time.monotonic()
        waited_on = {room.peer for room in self._rooms.values() if room.asked}
        for peer in waited_on:
            beat = self._beats.get(peer)
            if beat is not None and beat.done():
                ok = beat.exception() is None and beat.result()
                self._misses[peer] = 0 if ok else self._misses.get(peer, 0) + 1
                del self._beats[peer]
                if self._misses[peer] >= self.options.heartbeat_failures:
                    self._misses.pop(peer)
                    self._peers.pop(peer, None)
                    why = (f"the prefill at {peer[0]}:{peer[1]} is gone: its bootstrap server "
                           f"failed {self.options.heartbeat_failures} health checks")  # fmt: skip
                    for room in [r for r in self._rooms.values() if r.peer == peer and r.asked]:
                        outs += self._fail(room, why)
            if peer not in self._beats and now >= self._next_beat.get(peer, 0.0):
                self._next_beat[peer] = now + self.options.heartbeat_interval_s
                self._beats[peer] = self._fetcher.submit(_healthy, *peer)
        return outs

    def _mismatch(self, peer: tuple[str, int], facts: Future[dict[str, Any]]) -> str | None:
        where = f"the prefill at {peer[0]}:{peer[1]}"
        exc = facts.exception()
        if exc is not None:
            return f"{where} cannot be reached: {exc}"
        theirs = facts.result()
        if theirs.get("attn_tp_size") != len(self._ranks):
            return (
                f"{where} runs tensor parallel {theirs.get('attn_tp_size')}, this decode "
                f"{len(self._ranks)} (both must be equal)"
            )
        for name, ours in self.facts.items():
            if name in theirs and theirs[name] != ours:
                return f"{where} has {name} {theirs[name]!r}, this decode {ours!r}"
        return None

    def _staging_slots(self, room: _Room, count: int, blocks: list[int]) -> list[int] | None:
        """Where the prefill writes: the request's blocks, or staging slots for them (None:
        not free yet; []: more than the pool holds)."""
        if self._slots is None:
            return blocks
        if count > self._slots.num_slots:
            return []
        room.slots = self._slots.take(count)
        return room.slots

    def _too_long(self, count: int) -> str:
        assert self._slots is not None
        return (
            f"its prompt needs {count} KV pages, more than the {self._slots.num_slots} of this "
            "decode's host staging pool (--disaggregation-host-staging-tokens)"
        )

    def _ask(self, room: _Room, facts: dict[str, Any], num_tokens: int, blocks: list[int]) -> None:
        ask = KVRequest(room.room, num_tokens, list(blocks), self._ranks, self.endpoint)
        self._pushes.send(facts["kv_requests"], ask)
        room.asked = True

    def _arrive(
        self, room: _Room, token: int, logprobs: TokenLogprobs | None = None
    ) -> list[tuple[SequenceOutput, str | None]]:
        slots, room.slots = room.slots, None
        self._forget(room)
        core = self.engine.core
        seq = core.intake.remote.arrive(room.seq_id, token, logprobs)
        if slots is not None and seq is not None and not seq.is_finished:
            # The pages reach its blocks in the next plan, before its forward pass; the slots
            # are free once that step is applied.
            assert self._slots is not None
            copy = BlockCopy(STAGING_TIER, DEVICE_TIER, np.asarray(slots, np.int32),
                             np.asarray(seq.block_table[: len(slots)], np.int32))  # fmt: skip
            core.scheduler.block_manager.copy_in(copy)
            self._slots.give_after(core.pipeline.runner.step_id, slots)
        elif slots is not None:
            assert self._slots is not None
            self._slots.give(slots)
        if seq is None:
            return []
        return [(core.pipeline.output_of(seq), None)]

    def _fail(self, room: _Room, why: str) -> list[tuple[SequenceOutput, str | None]]:
        self._forget(room)
        core = self.engine.core
        seq = core.intake.remote.drop(room.seq_id, SequenceStatus.FINISHED_ABORTED)
        logger.warning("decode: room %d failed: %s", room.room, why)
        if seq is None:
            return []
        return [(core.pipeline.output_of(seq), why)]

    def _forget(self, room: _Room) -> None:
        self._rooms.pop(room.room, None)
        self._by_seq.pop(room.seq_id, None)
        if room.slots is not None:
            assert self._slots is not None
            self._slots.give(room.slots)
            room.slots = None

    def close(self) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._pushes.close()
        self._status.close(linger=0)


def _fetch_facts(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """The prefill's facts from its bootstrap server (SGLang's all -1 route), retried while it
    answers 503 or refuses (still starting), within `timeout_s`."""
    host_part = f"[{host}]" if ":" in host else host
    url = (
        f"http://{host_part}:{port}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
        "&target_tp_rank=-1&target_pp_rank=-1"
    )
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=max(left, 0.1)) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or left <= 0.5:
                raise RuntimeError(f"its bootstrap server answered {exc.code}") from None
        except (OSError, ValueError) as exc:
            if left <= 0.5:
                raise RuntimeError(f"its bootstrap server at {url}: {exc}") from None
        time.sleep(0.5)


def _healthy(host: str, port: int) -> bool:
    host_part = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{host_part}:{port}/health", timeout=2.0) as reply:
            return reply.status == 200
    except (OSError, ValueError):
        return False


def _made_up_token(seq_id: str, vocab_size: int) -> int:
    """SGLang's first token for a fake transfer: a hash of the request id in the vocabulary."""
    digest = hashlib.blake2b(seq_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab_size
