"""The handle rank 0 gives every worker, and the per-run names it holds.

Ownership: rank 0 makes the names (`RunNames.create`) and builds the handle; it travels to the
workers as bytes (a uint8 tensor broadcast over torch.distributed), so it is a typed record of
`shm_ipc.wire`'s codec (msgpack), nothing unpickled. Names are random per run and live in a private 0700 directory, so two runs
on one machine, or a stranger on it, cannot meet our sockets or shared memory.

Every name in here is removed by rank 0 as soon as every reader has attached (mappings and
connected sockets stay valid without their names). Until then, `remove_names` is also what a
worker calls when it finds rank 0 dead, so a crash during start-up leaves nothing behind either.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass

from shm_ipc import wire
from shm_ipc.paths import check_socket_path, private_dir
from shm_ipc.ring import SHM_DIR

HANDLE_VERSION = 2


class ChannelHandle(wire.Record, frozen=True):
    """Everything a worker needs to join the channel. Readers are ranks 1..num_readers: those
    on rank 0's node read the ring, the `remote_readers` get every message over TCP
    (`shm_ipc.remote`)."""

    shm_name: str  # file name under /dev/shm of the ring region
    plan_socket: str  # path of rank 0's XPUB doorbell socket (ipc://)
    back_socket: str  # path of rank 0's PULL socket for hellos and error reports
    run_dir: str  # the private 0700 directory holding both sockets
    owner_pid: int  # rank 0's pid, so a waiting worker can tell "idle" from "rank 0 died"
    slot_bytes: int  # payload capacity of one ring slot
    num_slots: int
    num_readers: int
    # Ranks on other nodes than rank 0's, and rank 0's TCP endpoints for them ("" without).
    remote_readers: tuple[int, ...] = ()
    remote_plan_address: str = ""
    remote_back_address: str = ""
    heartbeat_address: str = ""
    # The node of every rank, by rank (empty: all on one node), for messages that name them.
    nodes: tuple[int, ...] = ()

    @property
    def ring_readers(self) -> int:
        """How many ranks read the ring: the readers on rank 0's node."""
        return self.num_readers - len(self.remote_readers)

    def is_remote(self, rank: int) -> bool:
        return rank in self.remote_readers

    def ring_index(self, rank: int) -> int:
        """A local reader's ack byte in each ring slot: its place among the local readers."""
        return rank - 1 - sum(1 for r in self.remote_readers if r < rank)

    def ring_rank(self, index: int) -> int:
        """The rank of the local reader at ring index `index` (`ring_index`'s inverse)."""
        local = [r for r in range(1, self.num_readers + 1) if r not in self.remote_readers]
        return local[index]

    def node_of(self, rank: int) -> int:
        return self.nodes[rank] if rank < len(self.nodes) else 0

    def name(self, rank: int) -> str:
        """ "rank 2", or "rank 2 (node 1)" when the run spans nodes."""
        return f"rank {rank} (node {self.node_of(rank)})" if self.remote_readers else f"rank {rank}"

    @property
    def shm_path(self) -> str:
        return os.path.join(SHM_DIR, self.shm_name)

    def to_bytes(self) -> bytes:
        return wire.encode(_HandleFrame(HANDLE_VERSION, self))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ChannelHandle:
        """Decode `to_bytes` output; raises ValueError on anything else."""
        frame = wire.decode(_HANDLE, bytes(data), ValueError, "not a channel handle")
        if frame.version != HANDLE_VERSION:
            raise ValueError(
                f"channel handle version {frame.version}, this build reads {HANDLE_VERSION}"
            )
        return frame.handle


class _HandleFrame(wire.Record, frozen=True):
    """The handle as it travels, with its version first."""

    version: int
    handle: ChannelHandle


_HANDLE = wire.decoder(_HandleFrame)


@dataclass(frozen=True)
class RunNames:
    """The file-system names of one run: shm region, run directory and its two sockets."""

    shm_name: str
    run_dir: str
    plan_socket: str
    back_socket: str

    @classmethod
    def create(cls) -> RunNames:
        """Make the private run directory (mode 0700) and pick fresh random names."""
        run_dir = private_dir("tpe-")
        names = cls(
            shm_name=f"tpe-{os.getpid()}-{secrets.token_hex(6)}",
            run_dir=run_dir,
            plan_socket=os.path.join(run_dir, "plan.sock"),
            back_socket=os.path.join(run_dir, "back.sock"),
        )
        check_socket_path(names.plan_socket, run_dir)
        return names


def remove_names(shm_name: str, socket_paths: tuple[str, ...], run_dir: str) -> None:
    """Remove the run's names if they still exist (idempotent, never raises for a missing one).

    The directory is removed with rmdir, not rmtree: it holds only our sockets, and a handle
    that pointed somewhere else must not be able to delete anything but empty directories.
    """
    for path in (os.path.join(SHM_DIR, shm_name), *socket_paths):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    with contextlib.suppress(OSError):  # missing, or not empty: leave it
        os.rmdir(run_dir)


def remove_handle_names(handle: ChannelHandle) -> None:
    remove_names(handle.shm_name, (handle.plan_socket, handle.back_socket), handle.run_dir)
