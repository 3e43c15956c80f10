"""Tensor-parallel facts and the named collectives every parallel layer uses.

Every rank holds one shard of every layer of its pipeline stage; the ranks of one stage form one
tensor-parallel group. With one stage (no pipeline parallelism) that group is the default group
that torchrun's environment sets up (`TPInfo.group` None); with several, each stage's ranks get a
group of their own (`new_group`, made by `rank_worker.pp`), and the world group still carries
what every rank takes part in (the bootstrap, the KV-block agreement, control calls, the
sampled tokens). This module is the only place that talks to `torch.distributed`: layers
receive a `TPInfo` in their constructor and call the functions below, so a layer's docstring can
say exactly which collective its forward issues; `send_tensor` / `recv_tensor` carry a stage's
activations to the next one, between world ranks.

Backends: NCCL when CUDA is available, gloo otherwise (the CPU test path). A tensor on CUDA under
gloo is staged through host memory, since gloo reduces host buffers. A size-1 group never calls
into `torch.distributed`, so single-rank runs need no process group at all.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TPInfo",
    "all_gather",
    "all_gather_bytes",
    "all_reduce",
    "all_reduce_min_int",
    "barrier",
    "broadcast_bytes",
    "destroy_process_group",
    "gather_to_first",
    "init_process_group",
    "new_group",
    "recv_tensor",
    "send_tensor",
]


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in the tensor-parallel group, and the device it runs on.

    `local_rank` / `local_size`: its place among the ranks of this node (torchrun's LOCAL_RANK
    and LOCAL_WORLD_SIZE); local rank r runs on GPU `r % device_count` when CUDA is available,
    also over gloo, where ranks may outnumber GPUs and share them. `nodes`: the node of every
    rank, by rank, as the launcher numbers them (torchrun's GROUP_RANK; empty: one node).
    `init_process_group` decides all of it once; everything downstream reads it from here.

    `group`: the process group `rank` and `size` are counted in; None is the default (world)
    group. A pipeline stage's `TPInfo` (`rank_worker.pp`) names its stage's group, so its
    collectives stay inside the stage and `rank` is the rank within the stage (its `nodes` are
    left empty: the plan channel reads the world's).
    """

    rank: int
    size: int
    local_rank: int = 0
    local_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    nodes: tuple[int, ...] = ()
    group: Any = field(default=None, compare=False)  # a torch ProcessGroup, or None: the world

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid TPInfo(rank={self.rank}, size={self.size})")

    @property
    def is_first(self) -> bool:
        """Rank 0 of the group: of the world, rank 0 schedules and samples; of a stage, it is
        where the stage's logits are gathered."""
        return self.rank == 0

    def node_of(self, rank: int) -> int:
        return self.nodes[rank] if self.nodes else 0

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """The ranks on other nodes than rank 0's: the plan channel reaches them over TCP."""
        return tuple(r for r in range(self.size) if self.node_of(r) != self.node_of(0))

    @property
    def is_single(self) -> bool:
        """No communication is needed (and none is issued)."""
        return self.size == 1

    @property
    def ranks_on_device(self) -> int:
        """How many of this node's ranks share this rank's device (more than one only on a GPU
        over gloo, when ranks outnumber GPUs; every CPU rank has its own share of the host)."""
        if self.device.type != "cuda":
            return 1
        count = torch.cuda.device_count()
        return sum(1 for r in range(self.local_size) if r % count == self.local_rank % count)


ENV_NODE_RANK = "TP_ENGINE_NODE_RANK"


def launcher_node_rank() -> int:
    """This process's node as its launcher numbers it: torchrun's GROUP_RANK, else
    `$TP_ENGINE_NODE_RANK` (set by `tp-engine serve --node-rank`), else 0. Never the hostname:
    two "nodes" may share a host, and one host may carry several names."""
    return int(os.environ.get("GROUP_RANK") or os.environ.get(ENV_NODE_RANK) or 0)


def local_device(local_rank: int) -> torch.device:
    """GPU `local_rank % device_count` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    store: dist.Store | None = None,
    timeout_s: float = 600.0,
) -> TPInfo:
    """Join the process group described by torchrun's environment (or the explicit arguments).

    RANK and WORLD_SIZE come from the environment unless given; MASTER_ADDR/MASTER_PORT are read
    by torch's `env://` rendezvous unless `init_method` (e.g. `file:///tmp/x` in tests) or a
    ready `store` (see `rank_worker.dist.local_group`) is given.
    `backend` None picks NCCL with a GPU per rank and gloo otherwise. LOCAL_RANK decides the
    rank's device (`TPInfo.device`), selected first under NCCL so that it binds each rank to its
    own GPU. Once joined, the ranks all-gather their nodes (`launcher_node_rank`) into
    `TPInfo.nodes`. A world of one creates no group.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    tp = TPInfo(rank, world_size, local_rank, local_size, local_device(local_rank))
    if backend is None:
        # NCCL wants one GPU per rank; more ranks than GPUs (TP on a single GPU) use gloo, whose
        # collectives are staged through host memory.
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_size
        backend = "nccl" if enough_gpus else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
        torch.cuda.set_device(tp.device)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) already "
                f"exists; cannot join as rank {rank} of {world_size}"
            )
        return tp
    if tp.is_single:
        return tp
    dist.init_process_group(
        backend=backend,
        init_method=None if store is not None else (init_method or "env://"),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    nodes = torch.tensor([launcher_node_rank()], dtype=torch.int64, device=_comm_device())
    parts = [torch.empty_like(nodes) for _ in range(world_size)]
    dist.all_gather(parts, nodes)
    node_of = tuple(int(p.item()) for p in parts)
    return dataclasses.replace(tp, nodes=node_of if len(set(node_of)) > 1 else ())


def destroy_process_group() -> None:
    """Leave the group (a no-op when none was created)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _needs_host_staging(x: torch.Tensor, group: Any = None) -> bool:
    return x.is_cuda and dist.get_backend(group) == "gloo"


def _comm_device(group: Any = None) -> torch.device:
    """Where a freshly made buffer must live for the group's backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum `x` over all ranks, in place; returns `x`."""
    if tp.is_single:
        return x
    if _needs_host_staging(x, tp.group):
        host = x.cpu()
        dist.all_reduce(host, group=tp.group)
        x.copy_(host)
    else:
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather(x: torch.Tensor, tp: TPInfo, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` (same shape on all ranks) along `dim`, rank order."""
    if tp.is_single:
        return x
    staged = x.cpu() if _needs_host_staging(x, tp.group) else x
    staged = staged.contiguous()
    parts = [torch.empty_like(staged) for _ in range(tp.size)]
    dist.all_gather(parts, staged, group=tp.group)
    return torch.cat(parts, dim=dim).to(x.device)


def gather_to_first(x: torch.Tensor, tp: TPInfo, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's `x` along `dim` on rank 0; other ranks get None.

    Used for the vocab-parallel logits: only rank 0 samples, so the other ranks need not
    receive the full vocabulary.
    """
    if tp.is_single:
        return x
    staged = x.cpu() if _needs_host_staging(x, tp.group) else x
    staged = staged.contiguous()
    parts = [torch.empty_like(staged) for _ in range(tp.size)] if tp.is_first else None
    dist.gather(staged, gather_list=parts, group=tp.group, group_dst=0)
    if parts is None:
        return None
    return torch.cat(parts, dim=dim).to(x.device)


def broadcast_tensor(x: torch.Tensor, tp: TPInfo, src: int = 0) -> torch.Tensor:
    """Send rank `src`'s `x` to every rank, in place (same shape and dtype everywhere)."""
    if tp.is_single:
        return x
    if _needs_host_staging(x, tp.group):
        host = x.cpu()
        dist.broadcast(host, group=tp.group, group_src=src)
        if tp.rank != src:
            x.copy_(host)
    else:
        dist.broadcast(x, group=tp.group, group_src=src)
    return x


def broadcast_bytes(data: bytes | None, tp: TPInfo, src: int = 0) -> bytes:
    """Send `data` from rank `src` to every rank (others pass None); returns it everywhere.

    Two broadcasts of plain tensors (length, then uint8 payload): no pickle ever crosses ranks.
    """
    if not 0 <= src < tp.size:
        raise ValueError(f"broadcast_bytes: source rank {src} is not in a group of {tp.size}")
    if tp.rank == src and data is None:
        raise ValueError(f"broadcast_bytes: source rank {src} must pass bytes, got None")
    if tp.is_single and data is not None:
        return bytes(data)
    device = _comm_device(tp.group)
    length = torch.tensor([len(data) if tp.rank == src else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, group=tp.group, group_src=src)
    n = int(length.item())
    if n == 0:
        return b""
    if tp.rank == src:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(payload, group=tp.group, group_src=src)
    if tp.rank == src:
        return bytes(data)
    return payload.cpu().numpy().tobytes()


def all_gather_bytes(data: bytes, tp: TPInfo) -> list[bytes]:
    """Every rank's `data` (lengths may differ), in rank order, on every rank.

    For small messages such as control-call verdicts: two all-gathers of plain tensors (the
    lengths, then the payloads padded to the longest), no pickle, unlike
    `dist.all_gather_object`. Every rank must call it, in the same order as its other
    collectives.
    """
    if tp.is_single:
        return [bytes(data)]
    device = _comm_device(tp.group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(tp.size)]
    dist.all_gather(lengths, length, group=tp.group)
    sizes = [int(n.item()) for n in lengths]
    longest = max(sizes)
    if longest == 0:
        return [b""] * tp.size
    padded = bytearray(longest)
    padded[: len(data)] = data
    payload = torch.frombuffer(padded, dtype=torch.uint8).to(device)
    parts = [torch.empty_like(payload) for _ in range(tp.size)]
    dist.all_gather(parts, payload, group=tp.group)
    return [part.cpu().numpy().tobytes()[:n] for part, n in zip(parts, sizes, strict=True)]


def all_reduce_min_int(value: int, tp: TPInfo) -> int:
    """The smallest `value` over all ranks (e.g. the number of KV blocks every rank can hold)."""
    if tp.is_single:
        return int(value)
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device(tp.group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())


def barrier(tp: TPInfo) -> None:
    """Wait until every rank arrives."""
    if not tp.is_single:
        dist.barrier(group=tp.group)


def new_group(ranks: list[int]) -> Any:
    """A process group of the world ranks `ranks` (a collective over the whole world: every
    rank must make every group, in the same order, members or not), on the world's backend."""
    return dist.new_group(ranks)


def send_tensor(x: torch.Tensor, dst: int) -> None:
    """Send `x` to world rank `dst`, which must `recv_tensor` a buffer of the same shape and
    dtype. Blocking: returns once the transfer is done, so `x` may be reused at once."""
    if _needs_host_staging(x):
        x = x.cpu()
    dist.send(x.contiguous(), dst=dst)


def recv_tensor(x: torch.Tensor, src: int) -> torch.Tensor:
    """Fill `x` (its shape and dtype agreed with the sender) from world rank `src`; returns it."""
    if _needs_host_staging(x):
        host = torch.empty(x.shape, dtype=x.dtype)
        dist.recv(host, src=src)
        x.copy_(host)
    else:
        dist.recv(x, src=src)
    return x
