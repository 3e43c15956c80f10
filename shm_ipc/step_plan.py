"""The StepPlan: the one message rank 0 sends to every rank for every forward pass.

Ownership: rank 0's scheduler holds the request state and the running batch (one row per
running sequence, with its block table); every rank keeps a mirror of those block tables
(`rank_worker.inputs.block_tables`) that plans keep up to date. A plan carries the step's tokens and
the *changes* to the tables since the last plan, never whole tables, so a decode step's plan
does not grow with context length: at 256 sequences it is a few kilobytes whether they hold 1k
or 32k tokens (it grows by one block id per sequence every `block_size` steps). Sampling
parameters stay on rank 0.

Wire format (little-endian, explicit; nothing unpickled). A fixed header, then int32 arrays
back to back, then the plan's optional sections:

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
    36      4     num_sections S (uint32)
    40      ...   input_ids[T] query_start_loc[B+1] seq_lens[B] rows[B] logits_indices[B']
                  edit_rows[E] edit_starts[E] edit_offsets[E+1] edit_blocks[N]
                  section_table[2S]: (section id, length) per section, ids increasing
                  the sections' int32 payloads, in table order

Sections are what a feature adds to a plan (`SECTIONS`: each has a name, a wire id, the length
it must have and the values it may hold): a plan carries only the sections its step uses (a plan
without adapters carries no adapter slots), so a new feature adds one entry to `SECTIONS` and
leaves the header, the version and every other reader alone. A rank that meets a section id it
does not know refuses the plan (a rank built from another commit).

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

import dataclasses
import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

MAGIC = b"STPL"
# 3: the DRAFT command; 4: adapter_slots (multi-LoRA); 5: optional sections (adapter slots the
# first), so that features no longer change the version.
VERSION = 5
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
)


def batch_rows(max_num_seqs: int) -> int:
    """Rows of the running batch (and of every rank's table mirror) for `max_num_seqs`.

    Twice the sequence cap: with asynchronous scheduling a sequence whose in-flight sample is
    its last still holds its row for one more step while a newcomer takes its place in the
    step, so up to max_num_seqs rows can be ending while max_num_seqs others run.
    """
    return 2 * max_num_seqs


class SectionLength(enum.Enum):
    """How long a section must be, in the plan's own counts."""

    PER_SEQUENCE = "B"  # one value per sequence, in `seq_lens` order
    PER_TOKEN = "T"  # one value per new token, in `input_ids` order
    ANY = "any"  # a self-describing payload of any (non-zero) length


@dataclass(frozen=True)
class Section:
    """One optional part of a plan: what it holds, its wire id and the rules decode checks."""

    name: str
    wire_id: int  # never reused: a retired section keeps its id
    length: SectionLength
    min_value: int  # every value must be at least this (decode refuses the plan otherwise)
    doc: str

    def expected_length(self, num_tokens: int, num_seqs: int) -> int | None:
        return {
            SectionLength.PER_SEQUENCE: num_seqs,
            SectionLength.PER_TOKEN: num_tokens,
            SectionLength.ANY: None,
        }[self.length]


# Every section a plan may carry, by name. A feature adds its section here (and reads it on the
# ranks with `plan.section(name)`); nothing else in this module changes.
SECTIONS: dict[str, Section] = {
    section.name: section
    for section in (
        Section(
            "adapter_slots",
            1,
            SectionLength.PER_SEQUENCE,
            -1,
            "the LoRA adapter slot of each sequence, 0..max_loras-1, or -1 for the base model; "
            "sent only when some sequence runs an adapter. Each rank expands it per token "
            "(`rank_worker.inputs.input_prep`) for the LoRA layers; the upper bound (max_loras) is the "
            "rank's to check: the wire does not know it.",
        ),
        Section(
            "block_copies",
            2,
            SectionLength.ANY,
            0,
            "KV blocks to copy between tiers before the forward pass reads them (a prefix hit "
            "in host memory copied up, an evicted block copied down), in order, as "
            "`shm_ipc.block_copies.encode_block_copies` lays them out; block ids are the "
            "ranks' to bound-check.",
        ),
        Section(
            "eagle_drafts",
            3,
            SectionLength.PER_SEQUENCE,
            1,
            "an EAGLE-3 DRAFT plan: how many chained drafts each sequence wants; the ranks run "
            "the head's chain to the largest (`rank_worker.spec.eagle3_runner`).",
        ),
        Section(
            "hidden_rows",
            4,
            SectionLength.ANY,
            0,
            "token indices of a RUN plan whose EAGLE-3 target states (the three captured "
            "layers, concatenated) rank 0 wants back in `StepResult.hidden_states`; the ranks "
            "bound-check them against the plan's tokens.",
        ),
    )
}
_SECTIONS_BY_ID = {section.wire_id: section for section in SECTIONS.values()}


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


_EMPTY = _empty(0)
_EMPTY.flags.writeable = False


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
    # The optional sections this plan carries (`SECTIONS`), by name; each a 1-D int32 array of
    # the section's length. Absent means empty: read them with `section(name)`.
    sections: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_edits(self) -> int:
        return int(self.edit_rows.shape[0])

    def section(self, name: str) -> np.ndarray:
        """The named section's values, or an empty array when the plan does not carry it."""
        if name not in SECTIONS:
            raise KeyError(f"no StepPlan section {name!r}; known: {sorted(SECTIONS)}")
        return self.sections.get(name, _EMPTY)

    def with_sections(self, **arrays: np.ndarray) -> StepPlan:
        """A copy carrying these sections too (an empty array removes one)."""
        for name in arrays:
            if name not in SECTIONS:
                raise KeyError(f"no StepPlan section {name!r}; known: {sorted(SECTIONS)}")
        sections = {**self.sections, **arrays}
        return dataclasses.replace(
            self, sections={name: arr for name, arr in sections.items() if arr.size}
        )

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
        for name, arr in self.sections.items():
            section = SECTIONS.get(name)
            if section is None:
                raise ValueError(f"StepPlan.sections: unknown section {name!r}")
            length = section.expected_length(t, b)
            if arr.dtype != np.int32 or arr.ndim != 1 or arr.size == 0:
                raise ValueError(f"StepPlan section {name}: expected a non-empty 1-D int32 array")
            if length is not None and arr.shape != (length,):
                raise ValueError(f"StepPlan section {name}: expected ({length},), got {arr.shape}")
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
        return (t, b + 1, b, b, self.logits_indices.size, e, e, e + 1, n)

    def _section_arrays(self) -> list[np.ndarray]:
        """The table, then the payloads, in increasing wire id (one canonical encoding)."""
        present = sorted(
            ((SECTIONS[name], arr) for name, arr in self.sections.items() if arr.size),
            key=lambda item: item[0].wire_id,
        )
        table = np.array(
            [(section.wire_id, arr.size) for section, arr in present], dtype=np.int32
        ).reshape(-1)
        return [table, *(arr for _, arr in present)]

    def encoded_size(self) -> int:
        sections = sum(2 + arr.size for arr in self.sections.values() if arr.size)
        return HEADER_SIZE + 4 * (sum(self._counts()) + sections)

    def encode_into(self, buf: memoryview) -> int:
        """Write the plan into `buf` (at least `encoded_size()` bytes); returns bytes written."""
        arrays = _wire_arrays(self)
        if self.sections:
            table, *payloads = self._section_arrays()
            arrays = (*arrays, table, *payloads)
            num_sections = table.size // 2
        else:
            num_sections = 0
        total = sum(arr.size for arr in arrays)  # int32 elements after the header
        size = HEADER_SIZE + 4 * total
        if len(buf) < size:
            raise ValueError(f"buffer of {len(buf)} bytes is too small for a {size}-byte plan")
        input_ids, _, seq_lens, _, logits_indices, edit_rows, _, _, edit_blocks = arrays[:9]
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
            num_sections,
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
        magic, version, command, step_id, t, b, n_logits, e, n, n_sections = _HEADER.unpack_from(
            view, 0
        )
        if magic != MAGIC:
            raise PlanDecodeError(f"bad magic {magic!r}")
        if version != VERSION:
            raise PlanDecodeError(f"plan version {version}, this build reads {VERSION}")
        cmd = _COMMANDS.get(command)
        if cmd is None:
            raise PlanDecodeError(f"unknown command {command}")
        if n_sections > len(SECTIONS):
            raise PlanDecodeError(f"{n_sections} sections, this build knows {len(SECTIONS)}")
        counts = (t, b + 1, b, b, n_logits, e, e, e + 1, n)
        total = sum(counts)
        core_bytes = HEADER_SIZE + 4 * (total + 2 * n_sections)
        if len(view) < core_bytes:
            raise PlanDecodeError(f"plan of {len(view)} bytes, header says at least {core_bytes}")
        if (len(view) - HEADER_SIZE) % 4:
            raise PlanDecodeError(f"plan of {len(view)} bytes is not whole int32 values")
        body = np.frombuffer(view, dtype=_I32, offset=HEADER_SIZE)
        body.flags.writeable = False  # and so every view of it below
        arrays = []  # in ARRAY_FIELDS order, which is also the dataclass's field order
        offset = 0
        for count in counts:
            arrays.append(body[offset : offset + count])
            offset += count
        sections = _decode_sections(body, offset, n_sections, t, b)
        qsl, logits, offsets = arrays[1], arrays[4], arrays[7]
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
        return cls(step_id, cmd, *arrays, sections=sections)


def _decode_sections(
    body: np.ndarray, offset: int, n_sections: int, t: int, b: int
) -> dict[str, np.ndarray]:
    """The sections after the core arrays at `body[offset:]`: the table, checked entry by entry
    (known ids, increasing, the right lengths), then the payloads, which must end the buffer."""
    if not n_sections:
        if body.size != offset:
            raise PlanDecodeError(f"plan of {4 * body.size} body bytes, header says {4 * offset}")
        return {}
    table = body[offset : offset + 2 * n_sections].reshape(n_sections, 2)
    offset += 2 * n_sections
    sections: dict[str, np.ndarray] = {}
    last_id = 0
    for wire_id, length in table.tolist():
        section = _SECTIONS_BY_ID.get(wire_id)
        if section is None:
            raise PlanDecodeError(f"unknown section id {wire_id}")
        if wire_id <= last_id:
            raise PlanDecodeError("sections out of order or repeated")
        last_id = wire_id
        expected = section.expected_length(t, b)
        if length <= 0 or (expected is not None and length != expected):
            raise PlanDecodeError(
                f"section {section.name} of {length} values (must be {expected or 'non-zero'})"
            )
        if offset + length > body.size:
            raise PlanDecodeError(f"section {section.name} runs past the end of the plan")
        values = body[offset : offset + length]
        if np.count_nonzero(values < section.min_value):
            raise PlanDecodeError(f"{section.name} below {section.min_value}")
        sections[section.name] = values
        offset += length
    if offset != body.size:
        raise PlanDecodeError(f"plan of {4 * body.size} body bytes, header says {4 * offset}")
    return sections
