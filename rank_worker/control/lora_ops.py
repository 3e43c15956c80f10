"""Multi-LoRA's control ops (LOAD_LORA, UNLOAD_LORA) on one rank: checked on every rank in
`prepare`, applied by `rank_worker.lora.manager.LoraManager` in `commit` (see
`rank_worker.control.protocol` for the two phases). Importing this module registers the ops.

    op           args                                  refused when
    LOAD_LORA    slot: int, lora_uid: int | str,       LoRA is off; the weights sleep; slot
                 path: str                             out of range; the adapter is missing
                                                       or unservable (vLLM's messages,
                                                       `peft_adapter`)
    UNLOAD_LORA  slot: int, lora_uid (optional: also   LoRA is off; the weights sleep; slot
                 drop the host copy)                   out of range

Every rank reads the adapter itself (its host LRU, else `path`) and cuts its own shard, so
nothing travels over the TP group. A refusal's reason is the bare message (`lora_refusal`
takes it back out of the rank's reply for the engine). LOAD_LORA's commit returns
{"bytes": this rank's bytes written}; neither commit issues collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rank_worker.control.protocol import (
    _HANDLERS,
    ControlOp,
    ControlRefused,
    OpHandler,
    _check_keys,
)
from rank_worker.lora.manager import LoraManager, StagedLoad
from rank_worker.tp import TPInfo

if TYPE_CHECKING:
    from rank_worker.runner.model_runner import ModelRunner


def _manager(runner: ModelRunner) -> LoraManager:
    if runner.lora is None:
        raise ControlRefused("LoRA is not enabled (enable_lora)")
    # The slot stacks sleep with the weights: a write there would land in released storage.
    runner.device_sleep.check_weights_awake()
    return runner.lora


def _uid(args: Mapping[str, Any], required: bool) -> Any:
    uid = args.get("lora_uid")
    if (uid is not None or required) and (type(uid) not in (int, str)):
        raise ControlRefused(f"lora_uid must be an int or a str, got {uid!r:.200}")
    return uid


def _prepare_load(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> StagedLoad:
    _check_keys(args, {"slot", "lora_uid", "path"})
    manager = _manager(runner)
    path = args.get("path")
    if not isinstance(path, str):
        raise ControlRefused(f"path must be a str, got {path!r:.200}")
    try:
        return manager.prepare_load(args.get("slot"), _uid(args, True), path)
    except (ValueError, OSError) as exc:
        raise ControlRefused(str(exc)) from exc


def _commit_load(runner: ModelRunner, staged: StagedLoad) -> dict[str, int]:
    return {"bytes": _manager(runner).commit_load(staged)}


def _prepare_unload(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> tuple:
    _check_keys(args, {"slot", "lora_uid"})
    manager = _manager(runner)
    try:
        slot = manager.check_slot(args.get("slot"))
    except ValueError as exc:
        raise ControlRefused(str(exc)) from exc
    return slot, _uid(args, False)


def _commit_unload(runner: ModelRunner, prepared: tuple) -> None:
    _manager(runner).unload(*prepared)


_HANDLERS.update(
    {
        ControlOp.LOAD_LORA: OpHandler(_prepare_load, _commit_load),
        ControlOp.UNLOAD_LORA: OpHandler(_prepare_unload, _commit_unload),
    }
)
