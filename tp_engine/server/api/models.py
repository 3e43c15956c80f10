"""The API process's model registry: the names a request's `model` may give (vLLM's
`OpenAIServingModels`).

The base model answers to its served names; every LoRA adapter to its own name, which is how
a request picks its adapter. `/v1/models` lists both, adapters with `root` (their path) and
`parent` (the base model's name). Adapters come from `--lora-modules` (loaded by rank 0 before
Hello) and from `/v1/load_lora_adapter`; they leave with `/v1/unload_lora_adapter`, after
which their name is unknown at once (rank 0 lets the requests already sent finish on it).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from tp_engine.lora_request import LoRARequest
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.messages import Hello


def model_not_found(model: str) -> APIError:
    """vLLM's answer to an unknown `model`: 404 with a NotFoundError body."""
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code=404, type="NotFoundError"
    )


class ServedModels:
    def __init__(self, hello: Hello) -> None:
        self.base_names = list(hello.served_model_names)
        self.model_dir = hello.model_dir
        self.max_model_len = hello.max_model_len
        self.created = int(time.time())
        self.adapters: dict[str, LoRARequest] = {a.lora_name: a for a in hello.lora_modules}
        # Ids for adapters loaded at run time: after those rank 0 gave the static ones, and
        # never reused, so a reloaded name is a new adapter to rank 0 (and its prefix cache).
        first = max((a.lora_int_id for a in self.adapters.values()), default=0) + 1
        self._ids = itertools.count(first)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); raises the 404 if it names
        nothing served."""
        if model is None or model in self.base_names:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise model_not_found(model)
        return adapter

    def new_adapter(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path)

    def cards(self) -> list[dict[str, Any]]:
        """`/v1/models`'s data: the base names, then the adapters."""
        base = [
            self._card(name, self.model_dir, None, self.max_model_len) for name in self.base_names
        ]
        return base + [
            self._card(a.lora_name, a.lora_path, a.base_model_name or self.base_names[0], None)
            for a in self.adapters.values()
        ]

    def _card(self, name: str, root: str, parent: str | None, max_len: int | None) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "tp-engine",
            "root": root,
            "parent": parent,
            "max_model_len": max_len,
            "permission": [],
        }
