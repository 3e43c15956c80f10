"""Rank 0's calls that put adapters into the ranks' LoRA slots and take them out: each is one
control call to every rank (`tp_engine.control`; the ranks' side is `rank_worker.control_lora`).

The engine's adapter registry decides slots and load ids; these only carry the decision. A
refusal raises `ControlRefusedError` whose message is the rank's bare reason, vLLM's text
(e.g. "LoRA rank 32 is greater than max_lora_rank 16."), so the server can answer it as vLLM
does; nothing changed on any rank. To refuse before any call (and to tell a missing adapter,
a 404, from an unservable one), check with `rank_worker.lora.peft_adapter.read_adapter_config`
first.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from tp_engine.control import ControlOp, ControlRefusedError, ControlResult

if TYPE_CHECKING:
    from tp_engine.control import EngineControl


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
