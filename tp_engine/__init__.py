"""Rank 0's side of the runtime: the control plane, the engine and the offline API.

`SamplingParams`, `PoolingParams` and `EngineConfig` import nothing heavy; `LLM` and `LLMEngine` (which pull in
torch and the model) are loaded on first use, so the control plane stays importable alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tp_engine.config import EngineConfig
from tp_engine.features.structured.grammar import StructuredOutputsParams
from tp_engine.frontend.outputs import CompletionOutput, RequestOutput
from tp_engine.lora_request import LoRARequest
from tp_engine.pooling_params import PoolingParams
from tp_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tp_engine.engine import LLMEngine
    from tp_engine.frontend.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tp_engine.frontend.llm import LLM

        return LLM
    if name == "LLMEngine":
        from tp_engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'tp_engine' has no attribute {name!r}")
