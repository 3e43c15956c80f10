"""Rank 0's side of run-time weight updates: the engine operations behind `LLM.load_weights`,
`update_weights_from_disk`, the trainer-group calls (SGLang's names) and `get_weights_by_name`.

Each is one or more control calls (`tp_engine.executor.control`; the ranks' handlers and the data paths
are `rank_worker.control.weight_ops`), so an update lands between two steps, ordered with the
plans, and is validated on every rank before any rank writes. After a committed update:

- the block manager's weight epoch advances (`BlockManager.advance_epoch(flush_cache)`): K/V
  computed with the old weights is never a prefix-cache hit again, even K/V that a request
  kept running across the update still holds; `flush_cache` also frees the unreferenced
  cached blocks at once;
- `engine.weight_version` takes `weight_version` when one is given (None keeps the old one, as
  SGLang's `weight_version` argument does); it starts as "default".

A refusal raises `ControlRefusedError` naming the tensor (and both shapes for a wrong shape):
nothing changed on any rank, the epoch and version stay.

Buckets (`load_weights`): tensors travel from rank 0 in buckets of `bucket_bytes`, so another
rank holds at most one bucket beyond its weights. A sized input (a list, a dict, a state_dict's
items) is validated whole first, so an update larger than one bucket is still all or nothing. A
lazy iterator (a trainer gathering each tensor as it goes) is read one bucket at a time and
each bucket is validated before its writes; a bucket refused after earlier ones committed
leaves those written, and the error says how many (the epoch advances, since weights changed).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rank_worker.control.weight_group import DEFAULT_JOIN_TIMEOUT_S
from rank_worker.control.weight_ops import TensorMeta, dtype_name, stage_tensors
from tp_engine.executor.control import ControlOp, ControlRefusedError, ControlResult
from tp_engine.features.weights_and_sleep.group_join import (
    JOIN_GRACE_S,
    JOIN_POLL_S,
    join_timed_out,
)

if TYPE_CHECKING:
    from rank_worker.runner.model_runner import ModelRunner
    from tp_engine.core.hooks import CoreAccess
    from tp_engine.executor.control import EngineControl
    from tp_engine.features.weights_and_sleep.sleep import EngineSleep


class UpdateHost(Protocol):
    """What a weight update needs of the bring-up (`LLMEngine` is one; a protocol, so that
    this module and the engine do not import each other): the control calls, rank 0's model
    (its names and shapes), sleep mode, the checkpoint, the weights' label, and of the core
    only its `CoreAccess`."""

    core: CoreAccess
    control: EngineControl
    runner: ModelRunner  # rank 0's
    sleep_state: EngineSleep
    model_dir: Path
    weight_version: str


# Bytes of tensors per broadcast from rank 0 (vLLM's packed transfer uses 1 GiB, TRL 256 MB).
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_GROUP_NAME = "weight_update_group"


def _refused(result: ControlResult, op: str) -> ControlRefusedError:
    """Every rank refuses a bad batch for the same reason: name the first, count the rest."""
    failing = [reply for reply in result.replies if not reply.ok]
    message = failing[0].message if failing else result.message
    if len(failing) > 1:
        message += f" (and {len(failing) - 1} other ranks)"
    return ControlRefusedError(f"{op} refused: {message}")


def _committed(
    engine: UpdateHost,
    weight_version: str | None,
    flush_cache: bool,
    names: Iterable[str] | None = None,
) -> None:
    """After an update every rank committed: old K/V is never a hit again, the version is the
    caller's, and once an update has written every weight (`names`: the update's tensors; None:
    a whole checkpoint) weights that a level-2 sleep discarded count as loaded and ranks that a
    failed commit left inconsistent agree again."""
    engine.core.advance_kv_epoch(flush=flush_cache)
    if weight_version is not None:
        engine.weight_version = str(weight_version)
    needs_all = engine.sleep_state.weights_lost or engine.core.inconsistent is not None
    if needs_all and (names is None or _covers_every_weight(engine, names)):
        engine.sleep_state.note_weights_loaded()
        engine.core.note_consistent()


def _covers_every_weight(engine: UpdateHost, names: Iterable[str]) -> bool:
    """Whether tensors named `names` fill every part a checkpoint must provide, on every rank
    (each knows its own stage's parts: `WEIGHTS_COVERED`)."""
    result = engine.control.call(ControlOp.WEIGHTS_COVERED, {"names": sorted(set(names))})
    return result.ok and all(result.results)


def _named(weights: Any) -> Iterable[tuple[str, torch.Tensor]]:
    return weights.items() if isinstance(weights, Mapping) else weights


def _take_bucket(
    it: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[tuple[str, torch.Tensor]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in it:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"weights must be (str, Tensor) pairs, got ({name!r:.80}, {type(tensor)})"
            )
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            break
    return bucket


def load_weights(
    engine: UpdateHost,
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    weight_version: str | None = None,
    flush_cache: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> int:
    """Write full tensors (Hugging Face names, any float dtype, any subset) into the model on
    every rank; returns how many tensors. See the module docstring for buckets."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    named = _named(weights)
    if isinstance(named, Sized):
        named = list(named)
        total = sum(t.numel() * t.element_size() for _, t in named)
        if total > bucket_bytes:  # several calls: check the whole update before the first
            metas = [TensorMeta(n, t.dtype, tuple(t.shape)).to_args() for n, t in named]
            args = {"tensors": metas, "check_only": True}
            result = engine.control.call(ControlOp.LOAD_WEIGHTS, args)
            if not result.ok:
                raise _refused(result, "load_weights")
    it = iter(named)
    applied = 0
    written: list[str] = []
    try:
        while bucket := _take_bucket(it, bucket_bytes):
            metas = [TensorMeta(n, t.dtype, tuple(t.shape)).to_args() for n, t in bucket]
            stage_tensors(engine.runner, [t for _, t in bucket])
            try:
                args = {"tensors": metas, "bucket_bytes": bucket_bytes}
                result = engine.control.call(ControlOp.LOAD_WEIGHTS, args)
            finally:
                stage_tensors(engine.runner, None)
            if not result.ok:
                error = _refused(result, "load_weights")
                if applied:
                    raise ControlRefusedError(
                        f"{error} ({applied} tensors of earlier buckets were written: the "
                        "weights are partially updated)"
                    )
                raise error
            applied += len(bucket)
            written += [name for name, _ in bucket]
    finally:
        if applied:
            _committed(engine, None, flush_cache, written)
    if weight_version is not None:
        engine.weight_version = str(weight_version)
    return applied


def update_weights_from_disk(
    engine: UpdateHost,
    model_path: str | Path,
    *,
    weight_version: str | None = None,
    flush_cache: bool = True,
) -> None:
    """Load every weight from the safetensors checkpoint at `model_path` (each rank reads the
    files itself; the checkpoint must be whole and of this model's shapes, checked from the
    headers on every rank before any rank reads a tensor)."""
    result = engine.control.call(ControlOp.LOAD_WEIGHTS_FROM_DISK, {"path": str(model_path)})
    if not result.ok:
        raise _refused(result, "update_weights_from_disk")
    _committed(engine, weight_version, flush_cache)


class GroupJoinError(ControlRefusedError):
    """A trainer's group did not form (nobody listening, a rank failed, or the timeout): no rank
    keeps it, and the engine is unchanged (a 400, as SGLang answers)."""


def start_weights_update_group(
    engine: UpdateHost,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str | None = None,
    *,
    timeout_s: float | None = None,
) -> float:
    """Start joining a trainer's process group on every rank, in the background
    (`rank_worker.control.weight_group`): the trainer is its rank 0 and hosts its TCPStore at
    master_address:master_port; engine rank r becomes group rank `rank_offset + r`. `backend`
    None means nccl on GPU, gloo on CPU; `timeout_s` None is `DEFAULT_JOIN_TIMEOUT_S`. Returns
    the timeout in force (seconds); raises `ControlRefusedError` for bad arguments (nothing
    started)."""
    args = {
        "master_address": master_address, "master_port": int(master_port),
        "rank_offset": int(rank_offset), "world_size": int(world_size),
        "group_name": group_name, "backend": backend,
        "timeout_s": None if timeout_s is None else float(timeout_s),
    }  # fmt: skip
    result = engine.control.call(ControlOp.INIT_WEIGHTS_UPDATE_GROUP, args)
    if not result.ok:
        raise _refused(result, "init_weights_update_group")
    return DEFAULT_JOIN_TIMEOUT_S if timeout_s is None else float(timeout_s)


def weights_update_group_state(engine: UpdateHost, group_name: str) -> dict[str, Any]:
    """`{"state": "joined" | "pending", "pending_ranks": [...]}`: joined once every rank has
    joined; a join that failed on any rank is abandoned on every rank and raises
    `GroupJoinError` with each rank's reason."""
    args = {"group_name": group_name}
    result = engine.control.call(ControlOp.WEIGHTS_UPDATE_GROUP_STATUS, args)
    if not result.ok:
        raise _refused(result, "init_weights_update_group")
    errors = [f"rank {r.rank}: {r.result['error']}" for r in result.replies if r.result["error"]]
    if errors:
        abandon_weights_update_group(engine, group_name)
        raise GroupJoinError(
            f"init_weights_update_group {group_name!r} failed: {'; '.join(errors)}"
        )
    pending = [r.rank for r in result.replies if r.result["state"] != "joined"]
    return {"state": "pending" if pending else "joined", "pending_ranks": pending}


def abandon_weights_update_group(engine: UpdateHost, group_name: str) -> None:
    """Leave the group on every rank that formed it, and abandon the joins still under way."""
    args = {"group_name": group_name, "missing_ok": True}
    engine.control.call(ControlOp.DESTROY_WEIGHTS_UPDATE_GROUP, args)


def init_weights_update_group(
    engine: UpdateHost,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str | None = None,
    *,
    timeout_s: float | None = None,
) -> None:
    """`start_weights_update_group`, then wait (no step runs meanwhile: the offline `LLM`'s
    way; the server polls between steps instead) until every rank joined. `GroupJoinError`
    when the group does not form within the timeout (no rank keeps it)."""
    limit = start_weights_update_group(
        engine, master_address, master_port, rank_offset, world_size, group_name, backend,
        timeout_s=timeout_s,
    )  # fmt: skip
    deadline = time.monotonic() + limit + JOIN_GRACE_S
    while (state := weights_update_group_state(engine, group_name))["state"] != "joined":
        if time.monotonic() > deadline:
            abandon_weights_update_group(engine, group_name)
            raise GroupJoinError(join_timed_out(group_name, limit, state["pending_ranks"]))
        time.sleep(JOIN_POLL_S)


def update_weights_from_distributed(
    engine: UpdateHost,
    names: Sequence[str],
    dtypes: Sequence[str | torch.dtype],
    shapes: Sequence[Sequence[int]],
    *,
    group_name: str = DEFAULT_GROUP_NAME,
    weight_version: str | None = None,
    flush_cache: bool = True,
) -> None:
    """Receive full tensors by broadcast from the trainer (rank 0 of `group_name`), one per
    name in the order given, and write them on every rank. A refused update still receives
    and drops every announced tensor, so the trainer's broadcasts complete."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    tensors = [
        [str(n), dtype_name(d) if isinstance(d, torch.dtype) else str(d), [int(x) for x in s]]
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    ]
    args = {"group_name": group_name, "tensors": tensors}
    result = engine.control.call(ControlOp.LOAD_WEIGHTS_FROM_GROUP, args)
    if not result.ok:
        raise _refused(result, "update_weights_from_distributed")
    _committed(engine, weight_version, flush_cache, [str(n) for n in names])


def destroy_weights_update_group(engine: UpdateHost, group_name: str = DEFAULT_GROUP_NAME) -> None:
    """Leave the trainer's group on every rank."""
    result = engine.control.call(ControlOp.DESTROY_WEIGHTS_UPDATE_GROUP, {"group_name": group_name})
    if not result.ok:
        raise _refused(result, "destroy_weights_update_group")


def get_weights_by_name(engine: UpdateHost, name: str, truncate_size: int = 100) -> list[float]:
    """The first `truncate_size` values of checkpoint tensor `name`, flattened, as the full
    (gathered) tensor has them: every rank reports its shard's values among them and rank 0
    puts them in place, so the answer is the same at every TP size (SGLang's
    `get_weights_by_name`). Not for fp8 weights; for tests and checks, not speed."""
    from safetensors import safe_open

    from rank_worker.models.loader import safetensors_files

    # The full shape, from the checkpoint the engine started with (updates never change it).
    shape = None
    for path in safetensors_files(engine.model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if name in f.keys():  # noqa: SIM118
                shape = list(f.get_slice(name).get_shape())
                break
    if shape is None:
        raise ControlRefusedError(f"get_weights_by_name: {name!r} is not a checkpoint tensor")
    args = {"name": name, "shape": shape, "truncate_size": int(truncate_size)}
    result = engine.control.call(ControlOp.GET_WEIGHTS_BY_NAME, args)
    if not result.ok:
        raise _refused(result, "get_weights_by_name")
    numel = 1
    for d in shape:
        numel *= d
    values: list[float | None] = [None] * min(int(truncate_size), numel)
    for reply in result.replies:
        for i, v in zip(reply.result["index"], reply.result["values"], strict=True):
            if values[i] is None:
                values[i] = v
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise RuntimeError(f"get_weights_by_name: no rank holds elements {missing[:5]} of {name!r}")
    return values  # type: ignore[return-value]
