"""A trainer's weights update group, on one rank: formed as SGLang's server side forms it, joined
in the background, and the control ops that start, watch and leave it.

Why the layout matters. The trainer (rank 0 of the group) runs its own helper, SGLang's
`init_custom_process_group` or slime's copy of it; both ends must read and write the same
TCPStore keys or each waits for keys the other never writes. That helper, and SGLang's server
side, build the group in three layers, so this module does exactly the same:

    rendezvous("tcp://addr:port", rank, world_size)   the TCPStore (the trainer hosts it; every
                                                      member counts itself in on connecting)
    PrefixStore(group_name, store)                    the helper's own prefix
    torch's _new_process_group_helper(..., [], ...)   adds "<group_name>/" and "<device>/" and
                                                      sets the group's sequence number through
                                                      the store; registers the group with torch

A group built any other way (our ranks once made `ProcessGroupGloo(PrefixStore(name, store))`
directly) waits for different keys, and both sides time out. `_new_process_group_helper` is a
private torch function; both SGLang and slime call it, and the compatibility test runs SGLang's
own helper against a live server, so a torch release that changes it fails there.

Why in the background. Joining blocks until every member has connected (or the timeout), and a
control call runs between two steps on every rank: a join inside the call would stop generation
for as long as the trainer takes, and a blocked main thread cannot run the SIGTERM handler.
So the start op only starts a thread per rank (`PendingJoin`); rank 0 polls the status op
between steps until every rank has joined, one failed, or its deadline passed, and leaves (the
destroy op, which also abandons a join still under way: its thread leaves the group if it forms
after all). Nothing else may use a group until every rank reports it joined.

    op (args)                                         commit returns
    ──────────────────────────────────────────────    ────────────────────────────────────────
    INIT_WEIGHTS_UPDATE_GROUP  master_address,        {"rank"}: this rank's join has started
      master_port, rank_offset, world_size,
      group_name, backend, timeout_s
    WEIGHTS_UPDATE_GROUP_STATUS  group_name           {"state": "pending" | "joined" | "failed",
                                                       "error": str | None}
    DESTROY_WEIGHTS_UPDATE_GROUP  group_name,         True when this rank left or abandoned one
      missing_ok
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rank_worker.control.protocol import (
    _HANDLERS,
    ControlOp,
    ControlRefused,
    OpHandler,
    _check_keys,
)
from rank_worker.tp import TPInfo

if TYPE_CHECKING:
    from rank_worker.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How long a join may wait for the trainer and the other members when the request names no
# timeout (SGLang waits torch's default, 30 minutes, holding its scheduler meanwhile).
DEFAULT_JOIN_TIMEOUT_S = 120.0
# Each collective on a formed group (a trainer gathers every bucket before broadcasting it).
GROUP_OP_TIMEOUT_S = 600.0


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
) -> Any:
    """Join (rank 0: host) the group as SGLang's helper forms it (see the module docstring);
    returns the torch ProcessGroup. Blocks until every member joined, or raises after
    `timeout_s` (the collectives' own timeout is the larger of it and `GROUP_OP_TIMEOUT_S`)."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    join_timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{_host(master_address)}:{master_port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=join_timeout))
    store.set_timeout(join_timeout)
    prefixed = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        prefixed,
        group_name=group_name,
        timeout=timedelta(seconds=max(timeout_s, GROUP_OP_TIMEOUT_S)),
    )
    # Group rank == "global" rank inside this group, so `dist.broadcast(t, 0, group=pg)` (what
    # slime's trainer calls) resolves its source.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def leave_group(pg: Any) -> None:
    """Destroy a group made by `join_group` (torch forgets its name, so it can be made again)."""
    with contextlib.suppress(Exception):  # best effort: the group is forgotten either way
        dist.destroy_process_group(pg)


def weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
) -> tuple[Any, None]:
    """The trainer's side for our own tests: (process group, None) of rank `rank` (0 hosts the
    store). The same layout as SGLang's helper, which the compatibility test uses instead."""
    return join_group(
        master_address, master_port, rank, world_size, group_name, backend, timeout_s
    ), None


def group_broadcast(pg: Any, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast `tensor` from group rank `src`, in place, and wait for it."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    pg.broadcast([tensor], opts).wait()


@dataclass
class Group:
    pg: Any  # a torch ProcessGroup of `backend`, registered with torch under its name
    backend: str
    rank: int
    world_size: int


class PendingJoin:
    """One rank's join, running on its own thread (see the module docstring)."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.pg: Any = None
        self.error: str | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._thread = threading.Thread(
            target=self._run, name=f"join-{args['group_name']}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        a = self.args
        try:
            pg = join_group(
                a["master_address"], a["master_port"], a["rank"], a["world_size"],
                a["group_name"], a["backend"], a["timeout_s"],
            )  # fmt: skip
        except Exception as exc:  # reported by the status op
            with self._lock:
                self.error = f"{type(exc).__name__}: {exc}".strip()
                self.done.set()
            return
        with self._lock:
            if self._abandoned:  # nobody waits for it any more: leave at once
                leave_group(pg)
            else:
                self.pg = pg
            self.done.set()

    def abandon(self) -> None:
        """Nobody will use this group; whatever the thread forms, it leaves."""
        with self._lock:
            self._abandoned = True
            if self.pg is not None:
                leave_group(self.pg)
                self.pg = None


@dataclass
class _Groups:
    """One runner's trainer groups by name: formed, and still joining."""

    formed: dict[str, Group]
    joining: dict[str, PendingJoin]


# By runner: rank 0's runner shares its process with the caller, and a test may run several
# engines in one process.
_by_runner: weakref.WeakKeyDictionary[Any, _Groups] = weakref.WeakKeyDictionary()


def groups_of(runner: ModelRunner) -> _Groups:
    return _by_runner.setdefault(runner, _Groups({}, {}))


def formed_group(runner: ModelRunner, name: Any) -> Group:
    """The formed group `name`; ControlRefused when there is none (or it is still joining)."""
    groups = groups_of(runner)
    if isinstance(name, str) and name in groups.joining:
        _settle(groups, name)
    group = groups.formed.get(name) if isinstance(name, str) else None
    if group is None:
        raise ControlRefused(f"no weights update group named {name!r}")
    return group


def _settle(groups: _Groups, name: str) -> str:
    """Move a finished join to `formed`; its state."""
    join = groups.joining[name]
    if not join.done.is_set():
        return "pending"
    del groups.joining[name]
    if join.pg is None:
        return "failed"
    a = join.args
    groups.formed[name] = Group(join.pg, a["backend"], a["rank"], a["world_size"])
    return "joined"


def _default_backend(runner: ModelRunner) -> str:
    return "nccl" if runner.device.type == "cuda" else "gloo"


def _prepare_init(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> dict:
    keys = {"master_address", "master_port", "rank_offset", "world_size", "group_name",
            "backend", "timeout_s"}  # fmt: skip
    _check_keys(args, keys)
    a = dict(args)
    if not isinstance(a.get("master_address"), str):
        raise ControlRefused(f"master_address must be a str, got {a.get('master_address')!r}")
    for key in ("master_port", "rank_offset", "world_size"):
        if type(a.get(key)) is not int:
            raise ControlRefused(f"{key} must be an int, got {a.get(key)!r}")
    if not 0 < a["master_port"] < 65536:
        raise ControlRefused(f"master_port must be 1..65535, got {a['master_port']}")
    if a["rank_offset"] < 1 or a["rank_offset"] + tp.size > a["world_size"]:
        raise ControlRefused(
            f"ranks rank_offset .. rank_offset + {tp.size - 1} = {a['rank_offset']} .. "
            f"{a['rank_offset'] + tp.size - 1} do not fit a group of world_size "
            f"{a['world_size']} whose rank 0 is the trainer"
        )
    name = a.get("group_name")
    if not isinstance(name, str) or not name:
        raise ControlRefused(f"group_name must be a non-empty str, got {name!r}")
    groups = groups_of(runner)
    if name in groups.formed or name in groups.joining:
        raise ControlRefused(f"a weights update group named {name!r} exists already")
    backend = a.get("backend") or _default_backend(runner)
    if backend not in ("gloo", "nccl"):
        raise ControlRefused(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout_s = a.get("timeout_s")
    if timeout_s is None:
        timeout_s = DEFAULT_JOIN_TIMEOUT_S
    if not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ControlRefused(f"timeout must be a positive number of seconds, got {timeout_s!r}")
    a.update(backend=backend, rank=a["rank_offset"] + tp.rank, timeout_s=float(timeout_s))
    return a


def _commit_init(runner: ModelRunner, a: dict) -> dict[str, Any]:
    groups_of(runner).joining[a["group_name"]] = PendingJoin(a)
    return {"rank": a["rank"]}


def _prepare_status(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> str:
    _check_keys(args, {"group_name"})
    name = args.get("group_name")
    groups = groups_of(runner)
    if name not in groups.formed and name not in groups.joining:
        raise ControlRefused(f"no weights update group named {name!r}")
    return name


def _commit_status(runner: ModelRunner, name: str) -> dict[str, Any]:
    groups = groups_of(runner)
    if name in groups.formed:
        return {"state": "joined", "error": None}
    join = groups.joining[name]
    state = _settle(groups, name)
    return {"state": state, "error": join.error if state == "failed" else None}


def _prepare_destroy(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> str:
    _check_keys(args, {"group_name", "missing_ok"})
    name = args.get("group_name")
    groups = groups_of(runner)
    if name in groups.formed or name in groups.joining:
        return name
    if args.get("missing_ok"):
        return ""
    raise ControlRefused(f"no weights update group named {name!r}")


def _commit_destroy(runner: ModelRunner, name: str) -> bool:
    groups = groups_of(runner)
    join = groups.joining.pop(name, None)
    if join is not None:
        join.abandon()
        return True
    group = groups.formed.pop(name, None)
    if group is None:
        return False
    leave_group(group.pg)
    return True


GROUP_HANDLERS: dict[int, OpHandler] = {
    ControlOp.INIT_WEIGHTS_UPDATE_GROUP: OpHandler(_prepare_init, _commit_init),
    ControlOp.WEIGHTS_UPDATE_GROUP_STATUS: OpHandler(_prepare_status, _commit_status),
    ControlOp.DESTROY_WEIGHTS_UPDATE_GROUP: OpHandler(_prepare_destroy, _commit_destroy),
}

_HANDLERS.update(GROUP_HANDLERS)
