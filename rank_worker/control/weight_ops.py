"""Weight updates on one rank: the handlers of control ops 10, 11, 13, 15 and 17, registered into
`rank_worker.control.protocol`'s op table (whose two-phase protocol and rules they follow).

Every path ends in the same call, `runner.weight_map.apply(name, full_tensor)`: each rank gets
the *full* Hugging Face tensor and cuts its own shard in place (`rank_worker.models.weight_map`), so
storages and `data_ptr`s stay valid. What differs is where the full tensors come from:

    op                         args (msgpack)                        tensors come from
    ─────────────────────────  ────────────────────────────────────  ─────────────────────────────
    LOAD_WEIGHTS               tensors: [[name, dtype, shape], ...]  rank 0's caller (staged here
                               bucket_bytes: int, check_only: bool   by `stage_tensors`), packed
                                                                     into uint8 buckets and
                                                                     broadcast over the TP group
    LOAD_WEIGHTS_FROM_DISK     path: str                             each rank reads the
                                                                     safetensors files itself
    LOAD_WEIGHTS_FROM_GROUP    group_name, tensors: [[n, d, s], ..]  the trainer (rank 0 of the
                                                                     group), one broadcast per
                                                                     tensor, in the order given
    GET_WEIGHTS_BY_NAME        name, shape (full), truncate_size     (reads: this rank's values
                                                                     among the first ones)
    WEIGHTS_COVERED            names: [name, ...]                    (reads: whether the names
                                                                     fill every part this rank
                                                                     holds)

Pipeline parallelism: every rank takes part in every call (the calls' gathers and LOAD_WEIGHTS's
broadcasts span the world), and each stage writes only the tensors of its own layers (plus the
embedding on the first stage, the final norm and the LM head on the last, and a tied head's
`model.embed_tokens.weight` there too): the weight map resolves another stage's tensor to
nothing (`WeightMap.held_elsewhere`), so this rank neither checks nor writes it, and the stage
that holds it does both. GET_WEIGHTS_BY_NAME's values come from the stage that holds the tensor.

Phases. `prepare` validates the whole update's metadata (names, dtypes, full shapes, duplicates,
fp8 weight/scale pairs) with `WeightMap.prepare` on shape-only (meta) tensors, on every rank;
the rules read names and full shapes only, so every rank reaches the same verdict. Nothing is
received or written there. `commit` receives and writes. So a refused update changes nothing
anywhere, and a transport failure during commit is a failed commit (the engine then refuses to
step: the ranks may hold different weights).

Collectives. LOAD_WEIGHTS's commit issues the same broadcasts on every rank (every rank derives
the same buckets from the same metadata). A trainer's broadcasts start whatever our verdict,
so a refused LOAD_WEIGHTS_FROM_GROUP still receives and drops every announced tensor in its
`on_refused` hook (run by every rank, after the verdicts): the trainer's broadcasts complete
and it never hangs (TRL issue 6796). That needs the metadata to parse (dtype names torch
knows, shapes of non-negative ints) and the group to exist on the rank; otherwise the trainer's
own group timeout ends its wait.

The trainer's group itself (INIT_WEIGHTS_UPDATE_GROUP, WEIGHTS_UPDATE_GROUP_STATUS,
DESTROY_WEIGHTS_UPDATE_GROUP: how it is formed so that SGLang's trainer helper meets it, and why it
is joined in the background) is `rank_worker.control.weight_group`; this module only receives on it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from rank_worker.control.protocol import (
    _HANDLERS,
    ControlOp,
    ControlRefused,
    OpHandler,
    _check_keys,
)
from rank_worker.control.weight_group import Group, formed_group, group_broadcast
from rank_worker.models.loader import safetensors_files
from rank_worker.models.weight_map import WeightLoadError
from rank_worker.tp import TPInfo, broadcast_tensor

if TYPE_CHECKING:
    from rank_worker.runner.model_runner import ModelRunner

__all__ = [
    "WEIGHT_HANDLERS",
    "TensorMeta",
    "dtype_name",
    "parse_dtype",
    "stage_tensors",
]

# Offsets of tensors inside a bucket are multiples of this, so that each slice can be viewed
# as its dtype (a view must start at a multiple of the element size).
_ALIGN = 16

# safetensors header dtypes -> torch
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class TensorMeta(NamedTuple):
    """One announced full tensor: what every rank validates before anything moves."""

    name: str  # the checkpoint (Hugging Face) name
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def to_args(self) -> list[Any]:
        return [self.name, dtype_name(self.dtype), list(self.shape)]


def dtype_name(dtype: torch.dtype) -> str:
    """The name "bfloat16" for torch.bfloat16: the spelling in the call's args (SGLang's too)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """torch.bfloat16 for "bfloat16" or "torch.bfloat16"; ControlRefused for anything else."""
    dtype = (
        getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) else None
    )
    if not isinstance(dtype, torch.dtype):
        raise ControlRefused(f"unknown dtype {name!r}")
    return dtype


def _parse_metas(raw: Any) -> list[TensorMeta]:
    if not isinstance(raw, list):
        raise ControlRefused(f"tensors must be a list of [name, dtype, shape], got {raw!r:.200}")
    metas = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
            raise ControlRefused(f"each tensor must be [name, dtype, shape], got {item!r:.200}")
        name, dtype, shape = item
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ControlRefused(f"{name!r}: shape must be a list of ints >= 0, got {shape!r}")
        metas.append(TensorMeta(name, parse_dtype(dtype), tuple(shape)))
    return metas


def _validate(runner: ModelRunner, metas: Sequence[TensorMeta]) -> None:
    """Refuse unless the whole batch fits the model (names, shapes, dtypes, duplicates, fp8
    pairs): `WeightMap.prepare` on shape-only tensors, so nothing is allocated or written."""
    errors = runner.weight_map.prepare(
        (m.name, torch.empty(m.shape, dtype=m.dtype, device="meta")) for m in metas
    )
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise ControlRefused("; ".join(errors[:5]) + more)


# -- LOAD_WEIGHTS: full tensors from rank 0 ------------------------------------------------------

# Rank 0's tensors for its next LOAD_WEIGHTS call, by runner: the call's args carry metadata
# only (msgpack), the tensors stay in rank 0's process until the commit broadcasts them.
_staged: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def stage_tensors(runner: ModelRunner, tensors: list[torch.Tensor] | None) -> None:
    """Rank 0: hand the tensors of the next LOAD_WEIGHTS call to its handler (None clears)."""
    if tensors is None:
        _staged.pop(runner, None)
    else:
        _staged[runner] = tensors


@dataclass
class _Load:
    tp: TPInfo
    metas: list[TensorMeta]
    bucket_bytes: int
    tensors: list[torch.Tensor] | None  # rank 0 only
    check_only: bool = False


def _prepare_load(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> _Load:
    runner.device_sleep.check_weights_awake()  # a write to released storage: refused
    _check_keys(args, {"tensors", "bucket_bytes", "check_only"})
    metas = _parse_metas(args.get("tensors"))
    bucket_bytes = args.get("bucket_bytes", 1 << 28)
    if type(bucket_bytes) is not int or bucket_bytes <= 0:
        raise ControlRefused(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    check_only = bool(args.get("check_only", False))
    tensors = None
    if tp.is_first and not check_only:
        tensors = _staged.pop(runner, None)
        if tensors is None or len(tensors) != len(metas):
            raise ControlRefused("rank 0 has no staged tensors matching the call's metadata")
        for meta, t in zip(metas, tensors, strict=True):
            if (t.dtype, tuple(t.shape)) != (meta.dtype, meta.shape):
                raise ControlRefused(
                    f"{meta.name!r}: the staged tensor does not match its metadata"
                )
    _validate(runner, metas)
    return _Load(tp, metas, bucket_bytes, tensors, check_only)


def _buckets(metas: list[TensorMeta], bucket_bytes: int) -> Iterator[list[int]]:
    """Indices of `metas` in consecutive buckets of at most `bucket_bytes` (a larger tensor
    is a bucket of its own). Every rank derives the same buckets from the same metadata."""
    bucket: list[int] = []
    size = 0
    for i, meta in enumerate(metas):
        n = _aligned(meta.nbytes)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(i)
        size += n
    if bucket:
        yield bucket


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _commit_load(runner: ModelRunner, load: _Load) -> dict[str, int]:
    if load.check_only:
        return {"tensors": 0, "bytes": 0}
    wmap, tp, metas = runner.weight_map, load.tp, load.metas
    total = 0
    if tp.is_single:  # nothing to send: write straight from the caller's tensors
        assert load.tensors is not None
        for meta, tensor in zip(metas, load.tensors, strict=True):
            wmap.apply(meta.name, tensor)
            total += meta.nbytes
        return {"tensors": len(metas), "bytes": total}
    for bucket in _buckets(metas, load.bucket_bytes):
        offsets, size = [], 0
        for i in bucket:
            offsets.append(size)
            size += _aligned(metas[i].nbytes)
        # [size] uint8: the bucket's tensors' bytes, each at an aligned offset (no header: every
        # rank knows the layout from the metadata).
        buf = torch.empty(size, dtype=torch.uint8, device=runner.device)
        if tp.is_first:
            assert load.tensors is not None
            for i, off in zip(bucket, offsets, strict=True):
                src = load.tensors[i].detach().contiguous().reshape(-1).view(torch.uint8)
                buf[off : off + metas[i].nbytes].copy_(src)
        broadcast_tensor(buf, tp)
        for i, off in zip(bucket, offsets, strict=True):
            meta = metas[i]
            tensor = buf[off : off + meta.nbytes].view(meta.dtype).view(meta.shape)
            wmap.apply(meta.name, tensor)
            total += meta.nbytes
        del buf
    return {"tensors": len(metas), "bytes": total}


# -- LOAD_WEIGHTS_FROM_DISK ----------------------------------------------------------------------


@dataclass
class _Disk:
    files: list[str]
    metas: list[TensorMeta]


def _prepare_disk(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> _Disk:
    runner.device_sleep.check_weights_awake()  # a write to released storage: refused
    from safetensors import safe_open

    _check_keys(args, {"path"})
    path = args.get("path")
    if not isinstance(path, str):
        raise ControlRefused(f"path must be a str, got {path!r:.200}")
    try:
        files = [str(f) for f in safetensors_files(path)]
    except (WeightLoadError, OSError) as e:
        raise ControlRefused(str(e)) from e
    metas = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                sl = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ControlRefused(f"{name!r}: unsupported dtype {sl.get_dtype()}")
                metas.append(TensorMeta(name, dtype, tuple(sl.get_shape())))
    wmap = runner.weight_map
    # Published checkpoints store one tensor per expert, never transformers 5's fused layout.
    fused = [m.name for m in metas if wmap.resolve(m.name, fused=False) is None]
    if fused:
        raise ControlRefused(f"{fused[0]!r}: no weight of that name in the model")
    _validate(runner, metas)
    given = {t.name for m in metas for t in wmap.resolve(m.name) or []}
    missing = sorted(wmap.required - given)
    if missing:  # a checkpoint on disk is a whole model, as at start-up
        raise ControlRefused(f"checkpoint tensors missing for the model: {missing[:5]}")
    return _Disk(files, metas)


def _commit_disk(runner: ModelRunner, disk: _Disk) -> dict[str, int]:
    from safetensors import safe_open

    wmap, count = runner.weight_map, 0
    for file in disk.files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                # Read only what this rank keeps (other ranks' experts were checked by shape).
                if any(t.part.param is not None for t in wmap.resolve(name) or []):
                    wmap.apply(name, f.get_tensor(name))
                    count += 1
    return {"tensors": count}


# -- LOAD_WEIGHTS_FROM_GROUP: tensors from the trainer's group (`rank_worker.control.weight_group`) -------


def _recv_device(runner: ModelRunner, group: Group) -> torch.device:
    return runner.device if group.backend == "nccl" else torch.device("cpu")


@dataclass
class _FromGroup:
    group: Group
    metas: list[TensorMeta] = field(default_factory=list)


def _prepare_from_group(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> _FromGroup:
    runner.device_sleep.check_weights_awake()  # a write to released storage: refused
    _check_keys(args, {"group_name", "tensors"})
    group = formed_group(runner, args.get("group_name"))
    metas = _parse_metas(args.get("tensors"))
    _validate(runner, metas)
    return _FromGroup(group, metas)


def _commit_from_group(runner: ModelRunner, prepared: _FromGroup) -> dict[str, int]:
    # One tensor at a time: a rank holds at most one full tensor beyond its weights.
    device, total = _recv_device(runner, prepared.group), 0
    for meta in prepared.metas:
        tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        group_broadcast(prepared.group.pg, tensor)
        runner.weight_map.apply(meta.name, tensor)
        total += meta.nbytes
    return {"tensors": len(prepared.metas), "bytes": total}


def _drain_from_group(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> None:
    """Refused: still receive every announced tensor, and drop it, so the trainer's
    broadcasts complete (see the module docstring)."""
    try:
        group = formed_group(runner, args.get("group_name"))
        metas = _parse_metas(args.get("tensors"))
    except ControlRefused:
        return  # nothing to receive on (or nothing we can size): the trainer's timeout ends it
    device = _recv_device(runner, group)
    for meta in metas:
        group_broadcast(group.pg, torch.empty(meta.shape, dtype=meta.dtype, device=device))


# -- GET_WEIGHTS_BY_NAME -------------------------------------------------------------------------


def _prepare_get(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> tuple:
    _check_keys(args, {"name", "shape", "truncate_size"})
    name, shape, n = args.get("name"), args.get("shape"), args.get("truncate_size")
    if not isinstance(name, str):
        raise ControlRefused(f"name must be a str, got {name!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ControlRefused(f"{name!r}: shape must be a list of ints, got {shape!r}")
    if type(n) is not int or n < 0:
        raise ControlRefused(f"truncate_size must be an int >= 0, got {n!r}")
    wmap = runner.weight_map
    if wmap.held_elsewhere(name):  # another pipeline stage's tensor: that stage answers
        return None, (), 0
    targets = wmap.resolve(name, fused=False)
    if not targets:
        raise ControlRefused(f"{name!r}: no weight of that name in the model")
    if wmap.is_quantized(name):
        raise ControlRefused(f"{name!r} is fp8 in this model: its values are not readable alone")
    error = wmap.check(name, shape, torch.float32)
    if error is not None:
        raise ControlRefused(error)
    return targets[0], tuple(shape), n


def _commit_get(runner: ModelRunner, prepared: tuple) -> dict[str, list]:
    """This rank's values among the first `truncate_size` of the full tensor, with their flat
    indices. Which element of the full tensor each shard element holds is found by loading the
    tensor of flat indices (float64: exact below 2**53) through the parameter's own loader
    into a stand-in of the shard, so no shard geometry is written twice."""
    target, shape, n = prepared
    if target is None or target.part.param is None:  # another stage's tensor, rank's expert
        return {"index": [], "values": []}
    param = dict(runner.model.named_parameters())[target.part.param]
    numel = 1
    for d in shape:
        numel *= d
    full = torch.arange(numel, dtype=torch.float64).view(shape)
    where = torch.full(param.shape, -1.0, dtype=torch.float64)
    param.weight_loader(where, full, target.part.shard_id)  # type: ignore[attr-defined]
    mask = (where >= 0) & (where < n)
    values = param.detach().cpu().to(torch.float64)[mask]
    return {"index": where[mask].long().tolist(), "values": values.tolist()}


# -- WEIGHTS_COVERED -----------------------------------------------------------------------------


def _prepare_covered(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> bool:
    _check_keys(args, {"names"})
    names = args.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ControlRefused(f"names must be a list of str, got {names!r:.200}")
    return runner.weight_map.covers(names)


def _commit_covered(runner: ModelRunner, covered: bool) -> bool:
    return covered  # whether `names` fill every part this rank's stage holds


WEIGHT_HANDLERS: dict[int, OpHandler] = {
    ControlOp.LOAD_WEIGHTS: OpHandler(_prepare_load, _commit_load),
    ControlOp.LOAD_WEIGHTS_FROM_DISK: OpHandler(_prepare_disk, _commit_disk),
    ControlOp.LOAD_WEIGHTS_FROM_GROUP: OpHandler(
        _prepare_from_group, _commit_from_group, on_refused=_drain_from_group
    ),
    ControlOp.GET_WEIGHTS_BY_NAME: OpHandler(_prepare_get, _commit_get),
    ControlOp.WEIGHTS_COVERED: OpHandler(_prepare_covered, _commit_covered),
}

_HANDLERS.update(WEIGHT_HANDLERS)
