"""The StepPlan: the one message rank 0 sends to every rank for every forward pass.

Ownership: rank 0's scheduler holds mutable request state (`tp_engine.Sequence`); the plan
builder flattens one scheduled batch into this immutable value; every rank (rank 0 included)
turns it into GPU/CPU tensors for its forward pass. Workers hold no request state, so anything a
forward pass needs must be here. Sampling parameters stay on rank 0 and are not part of it.

Wire format (little-endian, explicit; nothing unpickled). A fixed header, then the int32 arrays back to back:

    offset  size  field
    0       4     magic  b"STPL"
    4       2     version (uint16)
    6       2     command (uint16, `Command`)
    8       8     step_id (uint64)
    16      4     num_tokens T (uint32)
    20      4     num_seqs B (uint32)
    24      4     block_table_width W (uint32)
    28      4     num_logits B' (uint32)
    32      ...   input_ids[T] positions[T] slot_mapping[T] query_start_loc[B+1]
                  seq_lens[B] block_table[B*W] logits_indices[B']   (all int32)

`decode` checks the magic, the version, the command and that the byte length matches the
counts exactly, and returns read-only numpy views into the buffer (no copy).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"STPL"
VERSION = 1
_HEADER = struct.Struct("<4sHHQIIII")
HEADER_SIZE = _HEADER.size  # 32 bytes
_I32 = np.dtype("<i4")
# The plan's arrays in wire order (see the module docstring).
ARRAY_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "block_table",
    "logits_indices",
)


class Command(enum.IntEnum):
    """What a rank does with a plan."""

    RUN = 1  # run one forward pass over the plan's tokens
    EXIT = 2  # leave the worker loop cleanly; the arrays are empty


class PlanDecodeError(ValueError):
    """Bytes that are not a well-formed StepPlan (truncated, corrupted or from another version)."""


def _empty(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.int32)


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One forward pass for every rank, as flat int32 arrays.

    T = num_tokens (new tokens computed this step over all sequences), B = num_seqs,
    W = widest block list in the batch, B' = number of rows whose logits rank 0 samples from.
    Sequences are laid out one after another in `input_ids`; sequence i owns tokens
    `query_start_loc[i] : query_start_loc[i + 1]`.
    """

    # Monotonic step counter from rank 0; errors and timeouts name it so a stuck step is findable.
    step_id: int
    # RUN or EXIT; workers never look a method up by name.
    command: Command
    # [T] token ids to embed: the not-yet-computed tail of each sequence (prefill chunk or the
    # one decode token).
    input_ids: np.ndarray
    # [T] absolute position of each token in its sequence, for the rotary embedding.
    positions: np.ndarray
    # [T] flat cache slot (block_id * block_size + offset) where this token's K/V is stored.
    slot_mapping: np.ndarray
    # [B+1] prefix sums of new tokens per sequence; the query layout for attention.
    query_start_loc: np.ndarray
    # [B] context length of each sequence after this step (cached prefix + new tokens); how far
    # attention reads into the paged cache.
    seq_lens: np.ndarray
    # [B, W] physical block ids of each sequence, padded with 0 past its own blocks (padding is
    # never read because seq_lens bounds every read).
    block_table: np.ndarray
    # [B'] rows of the flattened hidden states whose logits are needed: the last token of every
    # sequence that finishes its prompt or decodes this step (a mid-prompt chunk samples nothing).
    logits_indices: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def exit(cls, step_id: int) -> StepPlan:
        """The plan that tells workers to leave their loop."""
        return cls(
            step_id=step_id,
            command=Command.EXIT,
            input_ids=_empty(0),
            positions=_empty(0),
            slot_mapping=_empty(0),
            query_start_loc=_empty(1),
            seq_lens=_empty(0),
            block_table=_empty(0, 0),
            logits_indices=_empty(0),
        )

    def validate(self) -> None:
        """Check shapes and dtypes against each other; raises ValueError naming the field."""
        t, b = self.num_tokens, self.num_seqs
        expected = {
            "input_ids": (t,),
            "positions": (t,),
            "slot_mapping": (t,),
            "query_start_loc": (b + 1,),
            "seq_lens": (b,),
        }
        for name, shape in expected.items():
            arr = getattr(self, name)
            if arr.dtype != np.int32 or arr.shape != shape:
                raise ValueError(
                    f"StepPlan.{name}: expected int32 {shape}, got {arr.dtype} {arr.shape}"
                )
        if (
            self.block_table.dtype != np.int32
            or self.block_table.ndim != 2
            or self.block_table.shape[0] != b
        ):
            raise ValueError(
                f"StepPlan.block_table: expected int32 [{b}, W], got {self.block_table.shape}"
            )
        if self.logits_indices.dtype != np.int32 or self.logits_indices.ndim != 1:
            raise ValueError("StepPlan.logits_indices: expected a 1-D int32 array")
        if int(self.query_start_loc[-1]) != t:
            raise ValueError(
                f"StepPlan.query_start_loc ends at {int(self.query_start_loc[-1])}, not {t}"
            )

    # -- wire format ------------------------------------------------------------------------

    def encoded_size(self) -> int:
        return HEADER_SIZE + 4 * (
            3 * self.num_tokens
            + 2 * self.num_seqs
            + 1
            + self.block_table.size
            + self.logits_indices.size
        )

    def encode_into(self, buf: memoryview) -> int:
        """Write the plan into `buf` (at least `encoded_size()` bytes); returns bytes written."""
        size = self.encoded_size()
        if len(buf) < size:
            raise ValueError(f"buffer of {len(buf)} bytes is too small for a {size}-byte plan")
        _HEADER.pack_into(
            buf,
            0,
            MAGIC,
            VERSION,
            int(self.command),
            self.step_id,
            self.num_tokens,
            self.num_seqs,
            self.block_table.shape[1],
            self.logits_indices.shape[0],
        )
        offset = HEADER_SIZE
        for arr in self._arrays():
            n = arr.nbytes
            np.frombuffer(buf, dtype=_I32, count=arr.size, offset=offset)[:] = arr.reshape(-1)
            offset += n
        return offset

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
        magic, version, command, step_id, t, b, w, n_logits = _HEADER.unpack_from(view, 0)
        if magic != MAGIC:
            raise PlanDecodeError(f"bad magic {magic!r}")
        if version != VERSION:
            raise PlanDecodeError(f"plan version {version}, this build reads {VERSION}")
        try:
            cmd = Command(command)
        except ValueError:
            raise PlanDecodeError(f"unknown command {command}") from None
        counts = (t, t, t, b + 1, b, b * w, n_logits)
        expected = HEADER_SIZE + 4 * sum(counts)
        if len(view) != expected:
            raise PlanDecodeError(f"plan of {len(view)} bytes, header says {expected}")
        arrays = []
        offset = HEADER_SIZE
        for count in counts:
            arr = np.frombuffer(view, dtype=_I32, count=count, offset=offset)
            arr.flags.writeable = False
            arrays.append(arr.astype(np.int32, copy=False))
            offset += 4 * count
        ids, pos, slots, qsl, lens, table, logits_idx = arrays
        # Compared pairwise, not with np.diff: an int32 diff wraps around, and a wrapped jump
        # (e.g. 2**31 - 1 -> -2**31) would pass as an increase.
        if qsl[0] != 0 or qsl[-1] != t or bool(np.any(qsl[1:] < qsl[:-1])):
            raise PlanDecodeError(
                "query_start_loc is not a non-decreasing run from 0 to num_tokens"
            )
        if n_logits and (logits_idx.min() < 0 or logits_idx.max() >= t):
            raise PlanDecodeError("logits_indices out of range")
        return cls(
            step_id=step_id,
            command=cmd,
            input_ids=ids,
            positions=pos,
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_lens=lens,
            block_table=table.reshape(b, w),
            logits_indices=logits_idx,
        )

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, name) for name in ARRAY_FIELDS)
