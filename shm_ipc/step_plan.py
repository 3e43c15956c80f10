"""The StepPlan: the one message rank 0 sends to every rank for every forward pass.

Ownership: rank 0's scheduler holds the request state and the running batch (one row per
running sequence, with its block table); every rank keeps a mirror of those block tables
(`rank_worker.block_tables`) that plans keep up to date. A plan carries the step's tokens and
the *changes* to the tables since the last plan, never whole tables, so a decode step's plan
does not grow with context length: at 256 sequences it is a few kilobytes whether they hold 1k
or 32k tokens (it grows by one block id per sequence every `block_size` steps). Sampling
parameters stay on rank 0.

Wire format (little-endian, explicit; nothing unpickled). A fixed header, then int32 arrays
back to back:

    offset  size  field
    0       4     magic  b"STPL"
    4       2     version (uint16)
    6       2     command (uint16, `Command`)
    8       8     step_id (uint64)
    16      4     num_tokens T (uint32)
    20      4     num_seqs B (uint32)
    24      4     num_logits B' (uint32)
    28      4     num_edits E (uint32)
    32      4     num_edit_blocks N (uint32)
    36      4     num_adapter_slots A (uint32): B, or 0 when every sequence runs the base model
    40      ...   input_ids[T] query_start_loc[B+1] seq_lens[B] rows[B] logits_indices[B']
                  edit_rows[E] edit_starts[E] edit_offsets[E+1] edit_blocks[N]
                  adapter_slots[A]

The changes are edits, applied in order (the order things happened on rank 0 since the last
plan): edit e sets `table[edit_rows[e], edit_starts[e] + j] = edit_blocks[edit_offsets[e] + j]`
and the row's length to `edit_starts[e] + (edit_offsets[e+1] - edit_offsets[e])`. So an edit at
start 0 rewrites a row (a new sequence in it), one at the row's length appends blocks, and an
empty edit at start 0 gives the row up.

Everything else a rank needs is derived from these and its mirror: token i of sequence b sits
at position `seq_lens[b] - q_len[b] + (i - query_start_loc[b])`, its K/V goes to slot
`table[rows[b], pos // block_size] * block_size + pos % block_size`.

`decode` checks the magic, the version, the command and that the byte length matches the
counts exactly, and returns read-only numpy views into the buffer (no copy).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

MAGIC = b"STPL"
VERSION = 4  # 3: the DRAFT command; 4: adapter_slots (multi-LoRA)
_HEADER = struct.Struct("<4sHHQIIIIII")
HEADER_SIZE = _HEADER.size  # 40 bytes
_I32 = np.dtype("<i4")
# The plan's arrays in wire order (see the module docstring).
ARRAY_FIELDS = (
    "input_ids",
    "query_start_loc",
    "seq_lens",
    "rows",
    "logits_indices",
    "edit_rows",
    "edit_starts",
    "edit_offsets",
    "edit_blocks",
    "adapter_slots",
)


def batch_rows(max_num_seqs: int) -> int:
    """Rows of the running batch (and of every rank's table mirror) for `max_num_seqs`.

    Twice the sequence cap: with asynchronous scheduling a sequence whose in-flight sample is
    its last still holds its row for one more step while a newcomer takes its place in the
    step, so up to max_num_seqs rows can be ending while max_num_seqs others run.
    """
    return 2 * max_num_seqs


class Command(enum.IntEnum):
    """What a rank does with a plan."""

    RUN = 1  # run one forward pass over the plan's tokens
    EXIT = 2  # leave the worker loop cleanly; the arrays are empty
    # Speculative decoding with a draft model: one forward pass of the draft model alone, over
    # the plan's tokens (its logits rows are the draft's; the target's cache is untouched).
    DRAFT = 3


# A plan's arrays in wire order, in one call.
_wire_arrays = attrgetter(*ARRAY_FIELDS)
# Header value -> Command, without the enum's (slower) call.
_COMMANDS = {int(command): command for command in Command}


class PlanDecodeError(ValueError):
    """Bytes that are not a well-formed StepPlan (truncated, corrupted or from another version)."""


def _empty(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.int32)


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One forward pass for every rank, as flat int32 arrays.

    T = num_tokens (new tokens computed this step over all sequences), B = num_seqs,
    B' = rows whose logits rank 0 needs. Sequences are laid out one after another in
    `input_ids`; sequence b owns tokens `query_start_loc[b] : query_start_loc[b + 1]`.
    """

    # Monotonic step counter from rank 0; errors and timeouts name it so a stuck step is findable.
    step_id: int
    # RUN, DRAFT or EXIT; workers never look a method up by name.
    command: Command
    # [T] token ids to embed: the not-yet-computed tail of each sequence (prefill chunk or the
    # one decode token). `-1 - r` stands for the token sampled from logits row r of the step
    # before (asynchronous scheduling: rank 0 did not wait for it; every rank substitutes it on
    # the device).
    input_ids: np.ndarray
    # [B+1] prefix sums of new tokens per sequence; the query layout for attention.
    query_start_loc: np.ndarray
    # [B] context length of each sequence after this step (cached prefix + new tokens); how far
    # attention reads into the paged cache.
    seq_lens: np.ndarray
    # [B] each sequence's row of the block tables (stable while it runs).
    rows: np.ndarray
    # [B'] rows of the flattened hidden states whose logits are needed: the last token of every
    # sequence that samples this step, then any prompt-logprob rows.
    logits_indices: np.ndarray
    # Block-table edits since the last plan (see the module docstring): [E] rows and first
    # columns, and [E+1] offsets into the [N] block ids they write.
    edit_rows: np.ndarray
    edit_starts: np.ndarray
    edit_offsets: np.ndarray
    edit_blocks: np.ndarray
    # [B] or [0]: the LoRA adapter slot of each sequence (`seq_lens` order), 0..max_loras-1, or
    # -1 for the base model; empty when every sequence is base, so plans of engines without
    # adapters (and DRAFT, EXIT and warm-up plans) carry nothing. Each rank expands it per
    # token (`rank_worker.input_prep`) for the LoRA layers.
    adapter_slots: np.ndarray = field(default_factory=lambda: _empty(0))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_edits(self) -> int:
        return int(self.edit_rows.shape[0])

    @classmethod
    def exit(cls, step_id: int) -> StepPlan:
        """The plan that tells workers to leave their loop."""
        return cls(
            step_id=step_id,
            command=Command.EXIT,
            input_ids=_empty(0),
            query_start_loc=_empty(1),
            seq_lens=_empty(0),
            rows=_empty(0),
            logits_indices=_empty(0),
            edit_rows=_empty(0),
            edit_starts=_empty(0),
            edit_offsets=_empty(1),
            edit_blocks=_empty(0),
        )

    def validate(self) -> None:
        """Check shapes and dtypes against each other; raises ValueError naming the field."""
        t, b, e = self.num_tokens, self.num_seqs, self.num_edits
        expected = {
            "input_ids": (t,),
            "query_start_loc": (b + 1,),
            "seq_lens": (b,),
            "rows": (b,),
            "edit_rows": (e,),
            "edit_starts": (e,),
            "edit_offsets": (e + 1,),
        }
        for name, shape in expected.items():
            arr = getattr(self, name)
            if arr.dtype != np.int32 or arr.shape != shape:
                raise ValueError(
                    f"StepPlan.{name}: expected int32 {shape}, got {arr.dtype} {arr.shape}"
                )
        for name in ("logits_indices", "edit_blocks"):
            arr = getattr(self, name)
            if arr.dtype != np.int32 or arr.ndim != 1:
                raise ValueError(f"StepPlan.{name}: expected a 1-D int32 array")
        slots = self.adapter_slots
        if slots.dtype != np.int32 or slots.shape not in ((0,), (b,)):
            raise ValueError(
                f"StepPlan.adapter_slots: expected int32 (0,) or ({b},), got {slots.dtype} "
                f"{slots.shape}"
            )
        if int(self.query_start_loc[-1]) != t:
            raise ValueError(
                f"StepPlan.query_start_loc ends at {int(self.query_start_loc[-1])}, not {t}"
            )
        if int(self.edit_offsets[0]) != 0 or int(self.edit_offsets[-1]) != self.edit_blocks.size:
            raise ValueError("StepPlan.edit_offsets must run from 0 to len(edit_blocks)")

    # -- wire format ------------------------------------------------------------------------

    def _counts(self) -> tuple[int, ...]:
        t, b = self.num_tokens, self.num_seqs
        e, n = self.num_edits, self.edit_blocks.size
        return (t, b + 1, b, b, self.logits_indices.size, e, e, e + 1, n, self.adapter_slots.size)

    def encoded_size(self) -> int:
        return HEADER_SIZE + 4 * sum(self._counts())

    def encode_into(self, buf: memoryview) -> int:
        """Write the plan into `buf` (at least `encoded_size()` bytes); returns bytes written."""
        arrays = _wire_arrays(self)
        total = sum(arr.size for arr in arrays)  # int32 elements after the header
        size = HEADER_SIZE + 4 * total
        if len(buf) < size:
            raise ValueError(f"buffer of {len(buf)} bytes is too small for a {size}-byte plan")
        input_ids, _, seq_lens, _, logits_indices, edit_rows, _, _, edit_blocks, slots = arrays
        _HEADER.pack_into(
            buf,
            0,
            MAGIC,
            VERSION,
            self.command,
            self.step_id,
            input_ids.size,
            seq_lens.size,
            logits_indices.size,
            edit_rows.size,
            edit_blocks.size,
            slots.size,
        )
        # The arrays back to back, written by one concatenate straight into the buffer.
        body = np.frombuffer(buf, dtype=_I32, count=total, offset=HEADER_SIZE)
        np.concatenate(arrays, out=body)
        return size

    def encode(self) -> bytes:
        buf = bytearray(self.encoded_size())
        self.encode_into(memoryview(buf))
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> StepPlan:
        """Parse a plan; the arrays are read-only views into `data` (copy them to keep them)."""
        view = memoryview(data).cast("B")
        if len(view) < HEADER_SIZE:
            raise PlanDecodeError(
                f"{len(view)} bytes is shorter than the {HEADER_SIZE}-byte header"
            )
        magic, version, command, step_id, t, b, n_logits, e, n, n_slots = _HEADER.unpack_from(
            view, 0
        )
        if magic != MAGIC:
            raise PlanDecodeError(f"bad magic {magic!r}")
        if version != VERSION:
            raise PlanDecodeError(f"plan version {version}, this build reads {VERSION}")
        if n_slots not in (0, b):
            raise PlanDecodeError(f"{n_slots} adapter slots for {b} sequences (must be 0 or {b})")
        cmd = _COMMANDS.get(command)
        if cmd is None:
            raise PlanDecodeError(f"unknown command {command}")
        counts = (t, b + 1, b, b, n_logits, e, e, e + 1, n, n_slots)
        total = sum(counts)
        expected = HEADER_SIZE + 4 * total
        if len(view) != expected:
            raise PlanDecodeError(f"plan of {len(view)} bytes, header says {expected}")
        body = np.frombuffer(view, dtype=_I32, count=total, offset=HEADER_SIZE)
        body.flags.writeable = False  # and so every view of it below
        arrays = []  # in ARRAY_FIELDS order, which is also the dataclass's field order
        offset = 0
        for count in counts:
            arrays.append(body[offset : offset + count])
            offset += count
        qsl, logits, offsets, slots = arrays[1], arrays[4], arrays[7], arrays[9]
        # Compared pairwise, not with np.diff: an int32 diff wraps around, and a wrapped jump
        # (e.g. 2**31 - 1 -> -2**31) would pass as an increase.
        if qsl[0] != 0 or qsl[-1] != t or np.count_nonzero(qsl[1:] < qsl[:-1]):
            raise PlanDecodeError(
                "query_start_loc is not a non-decreasing run from 0 to num_tokens"
            )
        if offsets[0] != 0 or offsets[-1] != n or np.count_nonzero(offsets[1:] < offsets[:-1]):
            raise PlanDecodeError("edit_offsets is not a non-decreasing run from 0 to num_blocks")
        # One comparison for both bounds: seen as uint32, a negative index is above any T.
        if np.count_nonzero(logits.view(np.uint32) >= t):
            raise PlanDecodeError("logits_indices out of range")
        # The upper bound (max_loras) is the rank's to check: the wire does not know it.
        if np.count_nonzero(slots < -1):
            raise PlanDecodeError("adapter_slots below -1")
        return cls(step_id, cmd, *arrays)
