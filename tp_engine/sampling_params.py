"""Per-request sampling parameters, with vLLM's field names and defaults.

They live on rank 0 only: workers never see them (the StepPlan carries no sampling state).

Defaults, as in vLLM: `SamplingParams()` always has the documented defaults below. The
checkpoint's generation_config.json (temperature, top_k, top_p, min_p, repetition_penalty,
max_new_tokens) only fills fields a request leaves unset, which needs "unset" to be visible:
`SamplingParams.from_optional(defaults, **fields)` treats None as unset. `LLM.generate` without
sampling params and the API server (request fields it did not receive) go that way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgspec

from tp_engine.features.structured.grammar import StructuredOutputsParams

# Temperatures at or below this are greedy; dividing logits by them would overflow anyway.
GREEDY_EPSILON = 1e-5


@dataclass
class SamplingParams:
    """How to pick the tokens of one request. `temperature == 0` means greedy.

    Validation happens on construction and raises `ValueError` naming the field.
    """

    # Number of completions for the prompt.
    n: int = 1
    # Softmax temperature; 0 selects the most likely token (greedy).
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.
    top_p: float = 1.0
    # Keep the top_k most likely tokens; 0 or -1 turns it off (vLLM accepts both).
    top_k: int = 0
    # Drop tokens whose probability is below min_p times the top token's.
    min_p: float = 0.0
    # Penalties as in vLLM / OpenAI: presence and frequency in [-2, 2], repetition > 0.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Most tokens to generate; None = until max_model_len. 0 = a prompt-only request: the
    # prompt is computed (for `prompt_logprobs`, the way scoring clients use echo with
    # max_tokens 0) and nothing is generated. vLLM refuses 0; this engine runs it as such.
    max_tokens: int | None = 16
    # EOS and stop token ids do not end the request before this many tokens.
    min_tokens: int = 0
    # Keep generating past EOS (benchmarks).
    ignore_eos: bool = False
    # Strings that end the output (matched on detokenized text; not included in it).
    stop: list[str] = field(default_factory=list)
    # Token ids that end the output (the token itself is kept).
    stop_token_ids: list[int] = field(default_factory=list)
    # Per-request random seed: the same seed gives the same tokens whatever else runs.
    seed: int | None = None
    # Number of top log-probabilities to return per generated / prompt token; None = none.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Drop special tokens when detokenizing.
    skip_special_tokens: bool = True
    # Most tokens the model may think for (vLLM's name): once a sequence has generated this many
    # tokens since its thinking began and none was `think_end_token_id`, its next token is
    # `think_end_token_id` instead of a sampled one (`tp_engine.common.thinking.forced_think_end`).
    # None = no limit. The three fields after it say where thinking begins and ends; the API
    # server and `LLM.chat` fill them in from the tokenizer and the prompt
    # (`tp_engine.common.thinking.with_think_tokens`) when they are left unset.
    thinking_token_budget: int | None = None
    # Ids of `<think>` and `</think>`.
    think_start_token_id: int | None = None
    think_end_token_id: int | None = None
    # The prompt ends inside an open thinking block (the chat template opened it): thinking
    # begins with the first output token rather than after a `<think>` in the output.
    thinking_in_prompt: bool = False
    # What the output must match: a JSON schema, regex, choice or grammar (vLLM's field; a dict
    # of its fields is accepted). See `tp_engine.features.structured.grammar`; with the think token ids
    # set, the constraint applies after the thinking.
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to that token's logit before
    # temperature (and before penalties, as vLLM). String keys (JSON's) are read as ids.
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (the others are set to -inf); not empty.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never to complete. Each is tokenized with and without a leading space
    # (`tokenize_bad_words`); the last token of such a sequence is banned whenever the output
    # ends with the rest of it (a single-token word is always banned).
    bad_words: list[str] | None = None
    # The token sequences of `bad_words`, filled from the tokenizer by `tokenize_bad_words`
    # (the engine and the API server do it; set by hand only to ban token sequences directly).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self.logit_bias = _coerce_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        self._validate()

    @classmethod
    def from_optional(
        cls, defaults: Mapping[str, Any] | None = None, **fields: Any
    ) -> SamplingParams:
        """Parameters where a field given as None is unset: it takes its value from `defaults`
        (e.g. `tp_engine.config.generation.sampling_defaults`), else the class default.

        Unknown names in `fields` raise ValueError; unknown names in `defaults` are ignored.
        """
        names = _field_names(cls)
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"SamplingParams has no field {unknown[0]!r}")
        values = {k: v for k, v in (defaults or {}).items() if k in names and v is not None}
        values.update({k: v for k, v in fields.items() if v is not None})
        return cls(**values)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def as_fields(self) -> dict[str, Any]:
        """The fields by name, for a msgpack message (`SamplingParams(**fields)` rebuilds it):
        `logit_bias` keys as strings, since msgpack maps here take string keys only. Plain
        data throughout (the constraint as a dict, new lists), as `dataclasses.asdict` gives
        it, built by msgspec in one C pass: the API process does this once per request."""
        return msgspec.to_builtins(self, str_keys=True)

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the field for a token id at or above `vocab_size`."""
        for name, ids in (
            ("logit_bias", self.logit_bias or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
        ):
            bad = [t for t in ids if t >= vocab_size]
            _require(
                not bad,
                name,
                f"has token ids outside the vocabulary [0, {vocab_size}): {sorted(bad)[:5]}",
            )
        for ids in self.bad_words_token_ids or ():
            _require(
                all(t < vocab_size for t in ids),
                "bad_words",
                f"tokenize to ids outside the vocabulary [0, {vocab_size}): {ids}",
            )

    def check_first_step(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        """ValueError naming the field when the request's constraints leave no token to sample
        at its first step: `allowed_token_ids` minus single-token `bad_words`, minus the stop
        and EOS ids while `min_tokens` holds them back. (A grammar's own first-step mask is
        xgrammar's to check when it compiles.)"""
        banned = {ids[0] for ids in self.bad_words_token_ids or () if len(ids) == 1}
        if self.min_tokens > 0:
            banned.update(self.stop_token_ids)
            if not self.ignore_eos:
                banned.update(eos_token_ids)
        if self.allowed_token_ids is not None:
            num_left = len(set(self.allowed_token_ids) - banned)
            field_name = "allowed_token_ids"
        else:
            num_left = vocab_size - len({t for t in banned if t < vocab_size})
            field_name = "bad_words" if self.bad_words_token_ids else "min_tokens"
        _require(
            num_left > 0,
            field_name,
            "leaves no token that may be sampled at the first step "
            "(with bad_words, min_tokens' stop and EOS ids)",
        )

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1, got {!r}", self.n)
        _require(
            _is_real(self.temperature)
            and math.isfinite(self.temperature)
            and self.temperature >= 0,
            "temperature",
            "must be a finite number >= 0, got {!r}",
            self.temperature,
        )
        _require(
            _is_real(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            "must be in (0, 1], got {!r}",
            self.top_p,
        )
        _require(
            _is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            "must be -1 or 0 (off) or a positive integer, got {!r}",
            self.top_k,
        )
        _require(
            _is_real(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            "must be in [0, 1], got {!r}",
            self.min_p,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(
                _is_real(value) and -2.0 <= value <= 2.0,
                name,
                "must be in [-2, 2], got {!r}",
                value,
            )
        _require(
            _is_real(self.repetition_penalty)
            and math.isfinite(self.repetition_penalty)
            and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be a finite number > 0, got {!r}",
            self.repetition_penalty,
        )
        if self.max_tokens is not None:
            _require(
                _is_int(self.max_tokens) and self.max_tokens >= 0,
                "max_tokens",
                "must be an integer >= 0, got {!r}",
                self.max_tokens,
            )
        _require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            "must be an integer >= 0, got {!r}",
            self.min_tokens,
        )
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                "({}) must not exceed max_tokens ({})",
                self.min_tokens,
                self.max_tokens,
            )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a list of non-empty strings",
        )
        _require(
            all(map(_is_token_id, self.stop_token_ids)),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        if self.seed is not None:
            _require(
                _is_int(self.seed) and -_INT64_LIMIT <= self.seed < _INT64_LIMIT,
                "seed",
                "must be a 64-bit integer, got {!r}",
                self.seed,
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require(
                    _is_int(value) and value >= 0, name, "must be an integer >= 0, got {!r}", value
                )
        self._validate_thinking()
        self._validate_token_constraints()

    def _validate_token_constraints(self) -> None:
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                _require(
                    _is_token_id(token),
                    "logit_bias",
                    "keys must be token ids (integers >= 0), got {!r}",
                    token,
                )
                _require(
                    _is_real(bias) and -100.0 <= bias <= 100.0,
                    "logit_bias",
                    "values must be in [-100, 100], got {!r} for token {}",
                    bias,
                    token,
                )
        if self.allowed_token_ids is not None:
            _require(
                len(self.allowed_token_ids) > 0,
                "allowed_token_ids",
                "must not be empty (leave it unset to allow every token)",
            )
            _require(
                all(map(_is_token_id, self.allowed_token_ids)),
                "allowed_token_ids",
                "must be a list of non-negative integers",
            )
        if self.bad_words is not None:
            _require(
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                "must be a list of strings that are not empty or only spaces",
            )
        if self.bad_words_token_ids is not None:
            _require(
                all(ids and all(map(_is_token_id, ids)) for ids in self.bad_words_token_ids),
                "bad_words_token_ids",
                "must be a list of non-empty lists of non-negative integers",
            )

    def _validate_thinking(self) -> None:
        for name in ("thinking_token_budget", "think_start_token_id", "think_end_token_id"):
            value = getattr(self, name)
            if value is not None:
                _require(
                    _is_int(value) and 0 <= value < _INT64_LIMIT,
                    name,
                    "must be an integer >= 0, got {!r}",
                    value,
                )
        _require(
            isinstance(self.thinking_in_prompt, bool),
            "thinking_in_prompt",
            "must be a boolean, got {!r}",
            self.thinking_in_prompt,
        )


def tokenize_bad_words(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` with `bad_words_token_ids` filled from `bad_words` (a copy), or `params` itself
    when it has no bad words or they are tokenized already.

    Each word is tokenized as it is (a word at the start of the text) and after a space (in the
    middle of a text), as vLLM does, since the two give different tokens in BPE vocabularies;
    the second is kept when it differs from the first.
    """
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    sequences: list[list[int]] = []
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids not in sequences:
                sequences.append(ids)
    return dataclasses.replace(params, bad_words_token_ids=sequences)


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    """The dataclass's field names, read once (`dataclasses.fields` walks them every call)."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def _coerce_logit_bias(value: Any) -> Any:
    """A mapping with JSON's string keys ("42") or int keys -> {int: bias}; anything else is
    left for validation to refuse."""
    if value is None or not isinstance(value, Mapping):
        if value is not None:
            raise ValueError(
                f"SamplingParams.logit_bias must be a map of token id -> bias, got {value!r}"
            )
        return None
    out: dict[Any, Any] = {}
    for key, bias in value.items():
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                raise ValueError(
                    f"SamplingParams.logit_bias keys must be token ids, got {key!r}"
                ) from None
        out[key] = float(bias) if _is_int(bias) else bias
    return out


# Seeds and token ids cross process boundaries as msgpack / int64 tensors.
_INT64_LIMIT = 2**63


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: object) -> bool:
    """A non-negative integer that fits the int64 tensors token ids go into."""
    return _is_int(value) and 0 <= value < _INT64_LIMIT


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, field_name: str, message: str, *values: object) -> None:
    """ValueError "SamplingParams.<field> <message>" unless `ok`; `message` is a `str.format`
    template of `values`, formatted only then (the API process builds one SamplingParams per
    request, rank 0 another: each check's reprs were ~1 us, a third of the validation)."""
    if not ok:
        text = message.format(*values) if values else message  # (a message made already)
        raise ValueError(f"SamplingParams.{field_name} {text}")
