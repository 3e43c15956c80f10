"""Rank 0's side of LoRA: the engine operations behind `add_lora`, `remove_lora`,
`list_loras` and a request's `lora_request`, and the control calls that fill the ranks' slots.

The registry (`tp_engine.features.lora.registry.AdapterRegistry`) decides which adapter each device slot holds;
this module carries those decisions to every rank as LOAD_LORA and UNLOAD_LORA control calls
(`rank_worker.lora` prepares and commits them: a refusal on any rank changes no rank) and runs
the registry between steps (`prepare_slots`), where a control call may quiesce the engine.

A refusal raises `ControlRefusedError` whose message is the rank's bare reason, vLLM's text
(e.g. "LoRA rank 32 is greater than max_lora_rank 16."), so the server can answer it as vLLM
does; nothing changed on any rank. Adapters are checked on rank 0 first
(`rank_worker.lora.peft_adapter.read_adapter_config`), which also tells a missing adapter (a
404) from an unservable one.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from itertools import chain
from typing import TYPE_CHECKING, Any

from tp_engine.core.sequence import Sequence, SequenceStatus
from tp_engine.executor.control import ControlOp, ControlRefusedError, ControlResult, EngineControl
from tp_engine.features.lora.registry import AdapterRegistry
from tp_engine.lora_request import LoRARequest

if TYPE_CHECKING:
    from tp_engine.config import EngineConfig
    from tp_engine.core.hooks import CoreAccess, CoreHooks

logger = logging.getLogger(__name__)


def lora_refusal(result: ControlResult) -> str:
    """The first refusing rank's reason without the "rank r refused OP: " prefix (every rank
    refuses an adapter for the same reason)."""
    for reply in result.replies:
        if not reply.ok:
            return reply.message.split(": ", 1)[-1]
    return result.message


def load_lora(control: EngineControl, slot: int, lora_uid: int | str, path: str) -> int:
    """Put adapter `lora_uid` (read from `path` unless a rank has it in its host LRU) into
    device slot `slot` on every rank; returns the bytes rank 0 wrote."""
    result = control.call(ControlOp.LOAD_LORA, {"slot": slot, "lora_uid": lora_uid, "path": path})
    if not result.ok:
        raise ControlRefusedError(lora_refusal(result))
    return int(result.results[0]["bytes"])


def unload_lora(control: EngineControl, slot: int, lora_uid: Hashable | None = None) -> None:
    """Empty device slot `slot` on every rank; with `lora_uid`, also drop that adapter from the
    ranks' host LRU (an unloaded adapter: a later load reads the disk again)."""
    result = control.call(ControlOp.UNLOAD_LORA, {"slot": slot, "lora_uid": lora_uid})
    if not result.ok:
        raise ControlRefusedError(lora_refusal(result))


class ControlSlotLoader:
    """`SlotLoader` over the engine's control calls."""

    def __init__(self, control: EngineControl) -> None:
        self.control = control

    def load_slot(self, slot: int, lora_uid: int, path: str) -> None:
        load_lora(self.control, slot, lora_uid, path)

    def unload_slot(self, slot: int, lora_uid: int) -> None:
        unload_lora(self.control, slot, lora_uid)


def build_registry(config: EngineConfig, control: EngineControl) -> AdapterRegistry | None:
    """The engine's adapter registry (None without `enable_lora`); adapter configs are checked
    on rank 0 with the ranks' own rules before any rank is asked."""
    if not config.enable_lora:
        return None
    from rank_worker.lora.peft_adapter import read_adapter_config

    max_rank = config.max_lora_rank
    return AdapterRegistry(
        config.max_loras,
        ControlSlotLoader(control),
        lambda path: read_adapter_config(path, max_rank),
    )


def plug_in(reg: AdapterRegistry, core: CoreAccess, hooks: CoreHooks) -> None:
    """Plug LoRA into the engine core: adapters attach to new requests, the slots are filled
    before each step, a waiting sequence is admitted once its adapter has a slot, the
    registry follows the running batch's rows (its own per-row slots, which each plan carries
    as its `adapter_slots` section) and the stats name the adapters. The caller updates the
    core's gate once every feature is plugged in."""
    hooks.attach_adapter = lambda request, seqs: attach(reg, request, seqs)
    hooks.before_step.append(lambda outside: prepare_slots(reg, core, outside))
    hooks.admits = reg.admits
    hooks.plan_sections.append(reg.plan_sections)
    hooks.stats.append(lambda: adapter_stats(reg, core))
    core.follow_batch(reg.follow)


def registry(reg: AdapterRegistry | None, request: object) -> AdapterRegistry:
    if reg is None:
        raise ValueError(f"Got lora_request {request} but LoRA is not enabled!")
    return reg


def attach(reg: AdapterRegistry | None, request: LoRARequest, seqs: list[Sequence]) -> None:
    """Run `seqs` (a new request's) with `request`'s adapter, registering it on first use."""
    adapter = registry(reg, request).register(request)
    for seq in seqs:
        adapter.attach(seq)


def add_lora(reg: AdapterRegistry | None, request: LoRARequest) -> bool:
    """Register an adapter and load it into a slot if one can be had, so that every rank has
    checked it (vLLM's `add_lora`); False if its id is registered already. Raises ValueError
    (`ControlRefusedError` from a rank) when it cannot be served; nothing is kept then."""
    reg = registry(reg, request)
    if request.lora_int_id in reg.by_id:
        return False
    reg.preload(reg.register(request))
    return True


def remove_lora(reg: AdapterRegistry | None, lora_int_id: int) -> bool:
    """Stop serving an adapter (False if unknown): its running and waiting requests finish on
    it, then its slot is given back."""
    return reg is not None and reg.remove(lora_int_id)


def list_loras(reg: AdapterRegistry | None) -> set[int]:
    return set() if reg is None else set(reg.list_loras())


def adapter_stats(reg: AdapterRegistry, core: CoreAccess) -> dict[str, Any]:
    """`EngineStats`' LoRA fields: the slots and the adapters of running and waiting requests
    (by name, sorted)."""
    running = {a.request.lora_name for a in reg.by_load_id.values() if a.num_running}
    # A waiting sequence whose adapter was refused meanwhile (ended next step) names none.
    waiting = {
        adapter.request.lora_name
        for seq in core.waiting()
        if seq.adapter_id is not None and (adapter := reg.by_load_id.get(seq.adapter_id))
    }
    return {
        "max_lora": reg.max_loras,
        "running_lora_adapters": sorted(running),
        "waiting_lora_adapters": sorted(waiting),
    }


def prepare_slots(
    reg: AdapterRegistry, core: CoreAccess, outside: Iterable[Sequence]
) -> list[Sequence]:
    """Between steps: free the slots of removed adapters nobody uses (`outside`: sequences not
    in the scheduler yet), load the adapters the waiting queue needs. Returns the waiting
    sequences whose adapter the ranks refused, ended (aborted) here."""
    waiting = core.waiting()
    reg.release_removed(chain(waiting, outside))
    if not waiting:
        return []
    failed = reg.prepare_slots(waiting)
    for seq in failed:
        core.finish_request(seq.seq_id, SequenceStatus.FINISHED_ABORTED)
    return failed
