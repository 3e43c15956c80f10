"""The shared-memory ring: `num_slots` slots that rank 0 writes and every worker reads.

Ownership: rank 0 creates the region (`ShmRing.create`), each worker maps it (`ShmRing.attach`).
Rank 0 alone writes slot headers and payloads; reader i (rank i + 1) writes only its own ack
byte of each slot. The ring knows bytes, not plans: `broadcaster.py` decides what goes in a slot
and rings the doorbell (a ZeroMQ message, see `channel.py`) that tells readers which slot is
ready; `receiver.py` checks and copies it out.

Memory layout of /dev/shm/tpe-<pid>-<hex> (little-endian; every block 64-byte aligned):

    0        64                                                            64 + stride
    ┌────────┬──────────────────────────── slot 0 ───────────────────────┬── slot 1 ──┬─ ...
    │ ring   │ slot header (64 B)      │ acks (A B)     │ payload (P B)   │            │
    │ header │ seq step_id length      │ 1 byte per     │ one encoded     │    ...     │
    │ (64 B) │ checksum where          │ reader         │ StepPlan or     │            │
    │        │                         │                │ ControlCall     │            │
    └────────┴─────────────────────────┴────────────────┴─────────────────┴────────────┘

    ring header: magic b"TPERING\\0" | layout version u32 | num_slots u32 | num_readers u32 |
                 pad u32 | slot_bytes u64 | owner_pid u64   (attach checks it against the handle)
    slot header: seq u64 (1, 2, 3 ...; 0 = never written) | step_id u64 | length u64 |
                 checksum u64 (xxh3_64 of the payload) | where u8 (SLOT: payload in this slot;
                 DOORBELL: too big for P, the payload travels in the doorbell message)
    acks:        A = num_readers rounded up to 64; byte i belongs to rank i + 1
    payload:     P = slot_bytes rounded up to 64

Message number `seq` lives in slot `(seq - 1) % num_slots`. States of one slot:

    | acks          | header seq | who may write         | state                             |
    |---------------|------------|-----------------------|-----------------------------------|
    | all 1         | old or 0   | rank 0                | FREE: every reader is done with it|
    | all 1 → all 0 | old → new  | rank 0                | FILLING: payload, acks reset,     |
    |               |            |                       | header; no doorbell yet, so no    |
    |               |            |                       | reader looks at the slot          |
    | some 0        | new        | reader i: ack[i] only | PUBLISHED: doorbell sent; reader i|
    |               |            |                       | copies the payload, then ack[i]=1 |
    | all 1         | new        | rank 0                | FREE again                        |

Why each ordered write is ordered:

1. Rank 0 reads every ack of the slot as 1 before it writes anything into it: a reader with
   ack 0 may still be copying the payload. (The writes depend on that read through a branch,
   and no CPU we run on makes a store visible before the load its branch depends on.)
2. Rank 0 resets the acks to 0 before the doorbell: reset after it, a fast reader's ack could be
   erased and rank 0 would wait for it forever. It resets them after encoding the payload, so a
   plan that fails to encode leaves the slot FREE rather than waiting for acks that never come.
3. Rank 0 writes the payload, then the header with `seq` last, then rings the doorbell. The
   doorbell is what publishes: ZeroMQ hands it to the reader through lock-protected queues and a
   socket syscall, a release/acquire chain, so everything rank 0 wrote before sending is visible
   to a reader after it receives. `seq` last is the belt to those braces: a reader whose header
   does not carry the doorbell's seq has caught a lost message or a protocol bug, not a torn one.
4. A reader copies the payload into private memory, re-reads `seq` (unchanged, or rank 0 broke
   rule 1), and only then sets its ack byte, since rank 0 may overwrite the slot the moment it
   sees the ack. It verifies the checksum on its private copy, so even a reordering we did not
   foresee ends in a loud `CorruptMessageError`, never in a wrong plan.

Why acks are single bytes and not sequence counters: CPython gives no atomicity for multi-byte
stores into an mmap (`struct` packs standard-size integers byte by byte), and a byte cannot tear.
The multi-byte header fields are never read while being written (rule 1 and 3), so they need no
atomicity.

Why a region file and not `multiprocessing.shared_memory`: its resource tracker unlinks or warns
about segments across processes on Python 3.11. We `O_CREAT | O_EXCL` a 0600 file in /dev/shm
ourselves, and rank 0 unlinks it once every reader has mapped it, so no exit path (SIGKILL
included) can leave it behind: the kernel frees the memory when the last mapping goes.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
RING_MAGIC = b"TPERING\x00"
LAYOUT_VERSION = 1
_ALIGN = 64
_RING_HEADER = struct.Struct("<8sIIIIQQ")  # magic, version, slots, readers, pad, slot_bytes, pid
RING_HEADER_SIZE = _ALIGN
_SLOT_HEADER = struct.Struct("<QQQQB")  # seq, step_id, length, checksum, where
SLOT_HEADER_SIZE = _ALIGN
_SEQ = struct.Struct("<Q")
_SEQ_TAIL = struct.Struct("<QQQB")  # the slot header after seq, written before it


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Where(enum.IntEnum):
    """Where a message's payload is."""

    SLOT = 0  # in the slot's payload area
    DOORBELL = 1  # bigger than a slot: in the doorbell message; the slot only holds the header


@dataclass(frozen=True)
class SlotHeader:
    seq: int  # message number, 1-based; the doorbell carries the same number
    step_id: int  # the plan's step, so that errors can name it before decoding
    length: int  # payload bytes
    checksum: int  # xxh3_64 of the payload
    where: int  # a `Where`; kept as a raw int so that a corrupt value can be reported, not raised


class ShmRing:
    """A mapped ring region. Build with `create` (rank 0) or `attach` (workers)."""

    def __init__(self, mm: mmap.mmap, name: str, num_slots: int, num_readers: int, slot_bytes: int):
        self.name = name
        self.num_slots = num_slots
        self.num_readers = num_readers
        self.slot_bytes = slot_bytes  # payload capacity of one slot
        self._mm: mmap.mmap | None = mm
        self._acks_bytes = _round_up(num_readers)
        self._stride = SLOT_HEADER_SIZE + self._acks_bytes + _round_up(slot_bytes)

    @staticmethod
    def region_size(num_slots: int, num_readers: int, slot_bytes: int) -> int:
        return RING_HEADER_SIZE + num_slots * (
            SLOT_HEADER_SIZE + _round_up(num_readers) + _round_up(slot_bytes)
        )

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(
        cls, name: str, *, num_slots: int, num_readers: int, slot_bytes: int, owner_pid: int
    ) -> ShmRing:
        """Create /dev/shm/<name> (mode 0600, must not exist) and map it; every slot FREE."""
        size = cls.region_size(num_slots, num_readers, slot_bytes)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: a full /dev/shm then fails here with ENOSPC, not later with
            # SIGBUS on the first write into a page that cannot be backed.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
        _RING_HEADER.pack_into(
            mm, 0, RING_MAGIC, LAYOUT_VERSION, num_slots, num_readers, 0, slot_bytes, owner_pid
        )
        ring = cls(mm, name, num_slots, num_readers, slot_bytes)
        for slot in range(num_slots):
            off = ring._acks_offset(slot)
            mm[off : off + num_readers] = b"\x01" * num_readers
        return ring

    @classmethod
    def attach(
        cls, name: str, *, num_slots: int, num_readers: int, slot_bytes: int, owner_pid: int
    ) -> ShmRing:
        """Map an existing region and check that it is the one the handle describes."""
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            expected = cls.region_size(num_slots, num_readers, slot_bytes)
            if size != expected:
                raise ValueError(f"{path} has {size} bytes, the handle implies {expected}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        found = _RING_HEADER.unpack_from(mm, 0)
        want = (RING_MAGIC, LAYOUT_VERSION, num_slots, num_readers, 0, slot_bytes, owner_pid)
        if found != want:
            mm.close()
            raise ValueError(f"{path}: ring header {found} does not match the handle {want}")
        return cls(mm, name, num_slots, num_readers, slot_bytes)

    # -- layout ----------------------------------------------------------------------------

    def slot_of(self, seq: int) -> int:
        return (seq - 1) % self.num_slots

    def _slot_offset(self, slot: int) -> int:
        return RING_HEADER_SIZE + slot * self._stride

    def _acks_offset(self, slot: int) -> int:
        return self._slot_offset(slot) + SLOT_HEADER_SIZE

    def _payload_offset(self, slot: int) -> int:
        return self._acks_offset(slot) + self._acks_bytes

    @property
    def mm(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"ring {self.name} is closed")
        return self._mm

    # -- rank 0 (writer) -------------------------------------------------------------------

    def pending_readers(self, slot: int) -> list[int]:
        """Indices of the readers that have not acknowledged the slot's last message."""
        off = self._acks_offset(slot)
        acks = self.mm[off : off + self.num_readers]
        return [i for i, ack in enumerate(acks) if ack == 0]

    def is_free(self, slot: int) -> bool:
        off = self._acks_offset(slot)
        return self.mm.find(b"\x00", off, off + self.num_readers) < 0

    def reset_acks(self, slot: int) -> None:
        """FREE → FILLING (rule 2: before the doorbell)."""
        off = self._acks_offset(slot)
        self.mm[off : off + self.num_readers] = b"\x00" * self.num_readers

    @contextlib.contextmanager
    def payload_view(self, slot: int, length: int) -> Iterator[memoryview]:
        """A writable view of the first `length` payload bytes, released on exit (an mmap with
        live views cannot be closed)."""
        if length > self.slot_bytes:
            raise ValueError(f"{length} bytes do not fit a {self.slot_bytes}-byte slot")
        off = self._payload_offset(slot)
        with memoryview(self.mm) as whole, whole[off : off + length] as view:
            yield view

    def write_header(self, slot: int, header: SlotHeader) -> None:
        """Write the header, `seq` last (rule 3)."""
        off = self._slot_offset(slot)
        _SEQ_TAIL.pack_into(
            self.mm, off + 8, header.step_id, header.length, header.checksum, int(header.where)
        )
        _SEQ.pack_into(self.mm, off, header.seq)

    # -- readers ---------------------------------------------------------------------------

    def read_header(self, slot: int) -> SlotHeader:
        seq, step_id, length, checksum, where = _SLOT_HEADER.unpack_from(
            self.mm, self._slot_offset(slot)
        )
        return SlotHeader(seq, step_id, length, checksum, where)

    def read_seq(self, slot: int) -> int:
        return _SEQ.unpack_from(self.mm, self._slot_offset(slot))[0]

    def copy_payload(self, slot: int, length: int) -> bytes:
        """A private copy of the payload (rule 4: the slot may be overwritten after the ack)."""
        if length > self.slot_bytes:
            raise ValueError(f"length {length} exceeds the {self.slot_bytes}-byte slot")
        off = self._payload_offset(slot)
        return self.mm[off : off + length]

    def ack(self, slot: int, reader: int) -> None:
        """PUBLISHED → (FREE once every reader has acked); a single-byte store cannot tear."""
        self.mm[self._acks_offset(slot) + reader] = 1

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap (idempotent). The /dev/shm name is removed separately, see `handle.py`."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None
