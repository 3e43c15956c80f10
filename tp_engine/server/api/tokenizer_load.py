"""The API process's tokenizer, loaded without importing torch.

`transformers.AutoTokenizer` reads the checkpoint's config through `configuration_utils`, and
that module imports torch (transformers 5): half a gigabyte and seconds of start-up in a process
that holds no model. The class a checkpoint declares (`tokenizer_config.json`'s
`tokenizer_class`, e.g. `Qwen2Tokenizer` or `TokenizersBackend`) is what AutoTokenizer builds
for the checkpoints this server runs, and transformers imports a tokenizer class by name
without torch, so this loads that class directly. Anything else (no declared class, remote code
through `auto_map`, a name that is not a tokenizer class here, LlamaTokenizer's byte-level
special case) goes to AutoTokenizer as before, with a warning that torch comes with it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Classes AutoTokenizer may replace by another after reading the model's config.
_AUTO_DECIDES = frozenset({"LlamaTokenizer", "MistralCommonBackend"})


def declared_class(path: str) -> Any:
    """The tokenizer class the checkpoint at `path` declares, when it is one this module loads
    directly (see the module docstring); None otherwise."""
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class")
    if not isinstance(name, str) or "auto_map" in config:
        return None
    if name.removesuffix("Fast") in _AUTO_DECIDES:
        return None
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    for candidate in dict.fromkeys((name, name.removesuffix("Fast"))):
        try:
            cls = getattr(transformers, candidate)  # imports only that tokenizer's module
        except (AttributeError, ImportError):
            continue
        if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
            return cls
    return None


def load_tokenizer(path: str) -> Any:
    """The tokenizer at `path`, as `AutoTokenizer.from_pretrained(path)` gives it."""
    cls = declared_class(path)
    if cls is not None:
        return cls.from_pretrained(path)
    logger.warning(
        "%s declares no tokenizer class this process loads directly: AutoTokenizer (and torch "
        "with it) is imported",
        path,
    )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
