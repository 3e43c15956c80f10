"""What a checkpoint's generation_config.json contributes: EOS ids and sampling defaults.

As in vLLM, the defaults are the fields temperature, top_k, top_p, min_p, repetition_penalty and
max_new_tokens (as max_tokens); they apply only to fields a request leaves unset
(`SamplingParams.from_optional`), never to a `SamplingParams` the user built. `do_sample` is
ignored, as vLLM does: a checkpoint that wants greedy decoding says temperature 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tp_engine.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field.
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's generation_config.json as a dict; {} when it has none."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """SamplingParams field -> default, from the checkpoint's generation config.

    Checked on load: a value SamplingParams would refuse raises ValueError naming the file.
    """
    config = read_generation_config(model_dir)
    defaults = {
        field: config[key] for key, field in _SAMPLING_FIELDS.items() if config.get(key) is not None
    }
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{Path(model_dir) / 'generation_config.json'}: {exc}") from exc
    return defaults


def eos_token_ids(tokenizer: Any, model_dir: str | Path) -> set[int]:
    """EOS ids from the tokenizer and from generation_config.json (int or list), as vLLM does."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = read_generation_config(model_dir).get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(i) for i in eos)
    return ids
