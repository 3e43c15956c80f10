"""Which LoRA adapter a request runs with: vLLM's `LoRARequest`, a plain value the front ends,
the core and the LoRA feature (`tp_engine.features.lora`) all take."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's `LoRARequest`): `lora_int_id` (>= 1) names
    the adapter to the engine; `lora_path` is a PEFT directory every rank can read."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
