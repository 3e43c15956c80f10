"""`speculative_config`, in vLLM's shape: a dict (or its JSON) naming a method and its knobs.

    {"method": "ngram", "num_speculative_tokens": k,
     "prompt_lookup_min": a, "prompt_lookup_max": b}
    {"method": "draft_model", "model": DIR, "num_speculative_tokens": k}
    {"method": "eagle3", "model": HEAD_DIR, "num_speculative_tokens": k}

SGLang's spelling (`--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR
--speculative-num-steps k`) is turned into the same dict by `from_sglang`.

Unknown keys, a bad method or a bad value are refused with what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "eagle3")
# prompt_lookup_max when neither bound is given.
_DEFAULT_LOOKUP_MAX = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix of the sequence looked up in its earlier tokens.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = _DEFAULT_LOOKUP_MAX
    # draft_model: the drafter's checkpoint directory; eagle3: the head's (either published
    # layout, `rank_worker.spec.eagle3_format`).
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {METHODS}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an integer in [1, 64], got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
            raise ValueError("speculative_config: prompt_lookup_min/max must be integers")
        if not 1 <= lo <= hi:
            raise ValueError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{lo} and {hi}"
            )
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(
                f'speculative_config: method "{self.method}" needs "model" (a directory)'
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config: method "ngram" takes no "model"')

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """From what a user gives: the dict of `LLM(speculative_config=...)`, the JSON of
        `--speculative-config`, an instance, or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "model"}  # fmt: skip
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown keys {unknown}; this engine takes {sorted(known)}"
            )
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r}")
        fields = dict(value)
        lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        if hi is None:
            hi = max(_DEFAULT_LOOKUP_MAX, lo) if isinstance(lo, int) else _DEFAULT_LOOKUP_MAX
        fields["prompt_lookup_min"] = 1 if lo is None else lo
        fields["prompt_lookup_max"] = hi
        return cls(**fields)

    @classmethod
    def from_sglang(
        cls, algorithm: str | None, draft_model_path: str | None, num_steps: int | None
    ) -> SpeculativeConfig | None:
        """SGLang's flags as a config: `EAGLE3` (or `EAGLE`, which SGLang also runs EAGLE-3
        heads under when the head says so: here it must be an EAGLE-3 head) with the head's
        directory and the chain length; None when no algorithm is given."""
        if algorithm is None:
            if draft_model_path is not None or num_steps is not None:
                raise ValueError(
                    "--speculative-draft-model-path / --speculative-num-steps need "
                    "--speculative-algorithm EAGLE3"
                )
            return None
        if algorithm.upper() not in ("EAGLE3", "EAGLE"):
            raise ValueError(
                f"--speculative-algorithm {algorithm!r} is not supported (EAGLE3; for n-gram "
                "or a draft model use --speculative-config)"
            )
        if draft_model_path is None:
            raise ValueError("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path")
        return cls("eagle3", 3 if num_steps is None else num_steps, model=draft_model_path)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens
