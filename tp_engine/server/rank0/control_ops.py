"""The operations the admin routes run on rank 0's engine, by name: one table, checked arguments.

Ownership: the API process validates a route's body and sends `Control(call_id, op, args)`
(`tp_engine.server.messages`); rank 0's loop runs the operation between two steps, on its one
thread (the engine is not thread-safe), and answers `ControlReply`. Operations that need the
loop's own bookkeeping (`pause`: the aborted requests' last deltas, the reply of a "wait" pause
once the running requests are done) are the loop's; every other one is a row of `OPS`.

A refusal (`ValueError`, which `ControlRefusedError` is: a bad weight name or shape, an unknown
pause mode, a LoRA adapter the ranks cannot serve) is a 400 (a 404 for an adapter path or id
that is not there) with the engine unchanged and serving; any other exception a 500 (a bug in
the operation, logged); an `EngineDeadError` is not caught here: the loop ends the run as for a
failed step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tp_engine.common.failures import EngineDeadError
from tp_engine.executor.control import EngineInconsistentError
from tp_engine.features.lora.registry import LoRAAdapterNotFoundError
from tp_engine.features.weights_and_sleep import weight_updates
from tp_engine.lora_request import LoRARequest

if TYPE_CHECKING:
    from tp_engine.engine import LLMEngine

logger = logging.getLogger(__name__)

# Run by the loop itself (see the module docstring).
LOOP_OPS = frozenset({"pause"})


@dataclass(frozen=True)
class OpOutcome:
    status: int = 200
    message: str = ""
    result: dict[str, Any] = field(default_factory=dict)


def _weight_version(engine: LLMEngine, args: dict[str, Any]) -> dict[str, Any]:
    return {"weight_version": engine.weight_version}


def _reset_prefix_cache(engine: LLMEngine, args: dict[str, Any]) -> dict[str, Any]:
    """How many unreferenced cached blocks were dropped, and whether nothing stays cached
    (running requests keep theirs)."""
    dropped = engine.drop_cached_blocks()
    return {"num_dropped_blocks": dropped, "fully_reset": engine.num_cached_blocks == 0}


def _update_from_disk(engine: LLMEngine, args: dict[str, Any]) -> None:
    engine.update_weights_from_disk(
        args["model_path"],
        weight_version=args.get("weight_version"),
        flush_cache=args.get("flush_cache", True),
    )


def _start_group(engine: LLMEngine, args: dict[str, Any]) -> dict[str, Any]:
    """Only starts the ranks' joins: the route polls `_group_state` between steps, so that the
    loop never waits for a trainer (`rank_worker.control.weight_group`). The reply names the timeout in
    force (the ranks' default when none was asked), the route's deadline."""
    limit = weight_updates.start_weights_update_group(
        engine,
        args["master_address"],
        args["master_port"],
        args["rank_offset"],
        args["world_size"],
        group_name=args.get("group_name", "weight_update_group"),
        backend=args.get("backend"),
        timeout_s=args.get("timeout_s"),
    )
    return {"timeout_s": limit}


def _group_state(engine: LLMEngine, args: dict[str, Any]) -> dict[str, Any]:
    return weight_updates.weights_update_group_state(engine, args["group_name"])


def _abandon_group(engine: LLMEngine, args: dict[str, Any]) -> None:
    weight_updates.abandon_weights_update_group(engine, args["group_name"])


def _update_from_group(engine: LLMEngine, args: dict[str, Any]) -> None:
    engine.update_weights_from_distributed(
        args["names"],
        args["dtypes"],
        args["shapes"],
        group_name=args.get("group_name", "weight_update_group"),
        weight_version=args.get("weight_version"),
        flush_cache=args.get("flush_cache", True),
    )


def _update_from_tensor(engine: LLMEngine, args: dict[str, Any]) -> None:
    """SGLang's serialized named tensors, read here on rank 0 through the restricted unpickler
    (`tp_engine.features.weights_and_sleep.tensor_payload`), then loaded as `LLM.load_weights` loads tensors."""
    from tp_engine.features.weights_and_sleep.tensor_payload import decode_named_tensors

    named = decode_named_tensors(args["payload"], args.get("load_format"))
    engine.load_weights(
        named, weight_version=args.get("weight_version"), flush_cache=args.get("flush_cache", True)
    )


def _destroy_group(engine: LLMEngine, args: dict[str, Any]) -> None:
    engine.destroy_weights_update_group(args.get("group_name", "weight_update_group"))


def _weights_by_name(engine: LLMEngine, args: dict[str, Any]) -> dict[str, Any]:
    values = engine.get_weights_by_name(args["name"], truncate_size=args.get("truncate_size", 100))
    return {"values": values}


def _load_lora(engine: LLMEngine, args: dict[str, Any]) -> None:
    request = LoRARequest(args["lora_name"], args["lora_int_id"], args["lora_path"])
    if not engine.add_lora(request):
        raise ValueError(f"The lora adapter '{request.lora_name}' has already been loaded.")


def _unload_lora(engine: LLMEngine, args: dict[str, Any]) -> None:
    if not engine.remove_lora(args["lora_int_id"]):
        name = args.get("lora_name", args["lora_int_id"])
        raise LoRAAdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")


def _sleep(engine: LLMEngine, args: dict[str, Any]) -> None:
    engine.sleep(level=args.get("level", 1))


def _wake_up(engine: LLMEngine, args: dict[str, Any]) -> None:
    engine.wake_up(tags=args.get("tags"))


# name -> the engine call; a dict result goes back as the reply's `result`.
OPS: dict[str, Callable[[LLMEngine, dict[str, Any]], dict[str, Any] | None]] = {
    "resume": lambda engine, args: engine.resume(),
    "is_paused": lambda engine, args: {"is_paused": engine.pause_mode is not None},
    "reset_prefix_cache": _reset_prefix_cache,
    "get_weight_version": _weight_version,
    "update_weights_from_disk": _update_from_disk,
    "start_weights_update_group": _start_group,
    "weights_update_group_state": _group_state,
    "abandon_weights_update_group": _abandon_group,
    "update_weights_from_distributed": _update_from_group,
    "destroy_weights_update_group": _destroy_group,
    "update_weights_from_tensor": _update_from_tensor,
    "get_weights_by_name": _weights_by_name,
    "sleep": _sleep,
    "wake_up": _wake_up,
    "is_sleeping": lambda engine, args: {"is_sleeping": engine.is_sleeping()},
    "load_lora_adapter": _load_lora,
    "unload_lora_adapter": _unload_lora,
}


def run_op(engine: LLMEngine, op: str, args: dict[str, Any]) -> OpOutcome:
    """Run `op` on the engine; a refusal is a 400 naming why (see the module docstring)."""
    call = OPS.get(op)
    if call is None:
        return OpOutcome(400, f"unknown control operation {op!r}")
    try:
        result = call(engine, args)
    except EngineInconsistentError as exc:
        # A commit failed (a trainer killed mid-broadcast): the engine refuses requests with
        # 503 until a load of every weight repairs it; it is not dead.
        return OpOutcome(503, str(exc))
    except EngineDeadError:
        raise
    except LoRAAdapterNotFoundError as exc:
        return OpOutcome(404, str(exc))
    except (ValueError, TypeError, KeyError) as exc:
        return OpOutcome(400, str(exc) if not isinstance(exc, KeyError) else f"missing {exc}")
    except Exception as exc:  # a bug in an operation: a 500 for it, the engine serves on
        logger.exception("control operation %s failed", op)
        return OpOutcome(500, f"{op} failed: {type(exc).__name__}: {exc}")
    return OpOutcome(result=result or {})
