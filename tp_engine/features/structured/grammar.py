"""Structured outputs: a request's JSON schema, regex, choice or grammar, enforced per token.

Three parts, in the order a request meets them:

- `StructuredOutputsParams` (vLLM's name and fields) says what the output must match. It rides
  on `SamplingParams.structured_outputs`; `check()` parses it without a tokenizer (fast, cached)
  so that a bad schema, regex or grammar is refused when the request arrives, naming the field.
- `GrammarCompiler` turns it into an xgrammar `CompiledGrammar` for this engine's tokenizer: the
  vocabulary is read once per engine, compilations run on a few background threads at once
  (xgrammar releases the GIL), and their futures are cached by the constraint's text, so a
  request waits for its grammar while every other request keeps running, and the second request
  with the same schema waits for nothing. The engine gives each a deadline; a compilation past
  it ends its request and keeps its thread until it finishes (threads cannot be stopped), so a
  few slow constraints cannot hold up the others for long.
- `GrammarState` is one sequence's matcher. It follows the sequence's output tokens (`advance`,
  after each step's tokens are applied) and fills the sequence's row of the next step's token
  bitmask (`fill`); the sampler sets every token the row may not take to -inf
  (`tp_engine.core.sampling.grammar_mask`). The matcher follows the sequence's tokens, whatever
  happened to it: a preempted sequence keeps its tokens and its matcher, and a sequence whose
  output got shorter would roll its matcher back with it. Once the constraint is complete, only
  the stop tokens (the engine's EOS ids) remain allowed.

With a reasoning parser the constraint applies after the thinking (Qwen3's `</think>`), as in
vLLM: `SamplingParams.think_end_token_id` set means "this request thinks first", and where the
prompt leaves thinking (`tp_engine.common.thinking`) decides the first state:

    prompt's thinking   first state    next token's mask
    CLOSED              CONSTRAINED    the grammar's
    OPEN                THINKING       none, until `</think>` is in the output
    NOT_STARTED         UNDECIDED      the grammar's plus `<think>`: a model that opens a
                                       thinking block thinks freely, one that does not is
                                       constrained from its first token

JSON schemas are compiled with fixed whitespace (xgrammar's `any_whitespace=False`, vLLM's
`disable_any_whitespace`): a model cannot spend its tokens on newlines between keys, which
small or uncertain models otherwise do until max_tokens.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tp_engine.common.thinking import ThinkingState

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The kinds of constraint, in the order `StructuredOutputsParams` lists them.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# What `json_object` means: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
_ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    json         a JSON schema (a dict, or its text): the output is a JSON value it validates
    regex        a regular expression the whole output matches
    choice       a list of strings: the output is one of them
    grammar      an EBNF grammar (xgrammar's dialect, GBNF-like, start rule `root`)
    json_object  True: the output is a JSON object
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "SamplingParams.structured_outputs needs exactly one of "
                f"{', '.join(KINDS)}; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(self._field("json") + " must be a JSON schema (an object or text)")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(self._field(kind) + " must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(self._field("choice") + " must be a list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError(self._field("json_object") + " must be a boolean")

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """From what crosses a process boundary (a dict of its fields) or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"SamplingParams.structured_outputs must be a mapping of {', '.join(KINDS)}"
            )
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"SamplingParams.structured_outputs has no field {unknown[0]!r}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """The constraint as text: what compiled grammars are cached by."""
        kind = self.kind
        if kind == "json":
            schema = self.json
            return kind, schema if isinstance(schema, str) else json.dumps(schema)
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, _ANY_OBJECT
        return kind, getattr(self, kind)

    def check(self) -> None:
        """Parse the constraint (no tokenizer needed); ValueError naming the field if it is not
        a valid JSON schema, regex or grammar. Cached by the constraint's text."""
        error = _parse_error(*self.key)
        if error is not None:
            raise ValueError(self._field(self.kind) + f" is not valid: {error}")

    @staticmethod
    def _field(kind: str) -> str:
        return f"SamplingParams.structured_outputs.{kind}"


# How `StructuredOutputsParams` names a field in its errors; a server names the request's field.
_OWN_FIELD = re.compile(r"SamplingParams\.structured_outputs(\.\w+)?")


def parse_refusal(fields: dict[str, Any], param: str) -> str | None:
    """Why the constraint `StructuredOutputsParams(**fields)` is refused (its fields, or it does
    not parse), naming `param` (the request's field that carried it) where this module names
    its own; None when it parses. Parsing imports xgrammar, and xgrammar imports torch: the
    server runs this on rank 0, never in its API process (`tp_engine.server.api.constraints`
    sends the checks along with the request)."""
    try:
        StructuredOutputsParams(**fields).check()
    except ValueError as exc:
        return _OWN_FIELD.sub(param, str(exc), count=1)
    return None


def _grammar(kind: str, text: str) -> Any:
    """The xgrammar `Grammar` of a constraint (raises on a bad one)."""
    import xgrammar as xgr  # deferred: only requests with a constraint need it

    if kind in ("json", "json_object"):
        schema = json.loads(text)  # a str schema must be JSON before it is a schema
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return xgr.Grammar.from_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        # EBNF string literals take JSON's escapes.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    return xgr.Grammar.from_ebnf(text)


@functools.lru_cache(maxsize=1024)
def _parse_error(kind: str, text: str) -> str | None:
    try:
        _grammar(kind, text)
    except (ValueError, RuntimeError) as exc:
        # xgrammar's messages start with a timestamp and a C++ source location.
        return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
    return None


def _stamp_finish(future: Future) -> None:
    """Record when a compilation finished (`compile_verdict` compares that, not the moment the
    engine looked, with a request's deadline)."""
    future.finished_at = time.monotonic()  # type: ignore[attr-defined]


def compile_verdict(future: Future, deadline: float, timeout_s: float) -> tuple[bool, str | None]:
    """(settled, why) of a request's compilation: settled once it finished or its deadline
    passed; `why` says what ended the request (None: compiled in time). A compilation that
    finished after the deadline counts as late even if the engine looks only then (a busy
    step, or a compile thread holding the GIL, must not turn a timeout into a success)."""
    now = time.monotonic()
    if future.done():
        finished_at = getattr(future, "finished_at", now)  # the stamp follows done() closely
        if finished_at <= deadline:
            error = future.exception()
            return (
                True,
                None if error is None else f"its output constraint failed to compile: {error}",
            )
    elif now <= deadline:
        return False, None
    return True, (
        f"its output constraint did not compile within {timeout_s:g} s (structured outputs timeout)"
    )


class GrammarCompiler:
    """Compiles constraints for one engine's tokenizer, off the step path, cached by text."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_size: int = 256,
        workers: int = 4,
    ) -> None:
        self._tokenizer = tokenizer
        self._workers = workers
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None  # built on the first request with a constraint
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the CompiledGrammar of `params` (shared with earlier requests for the
        same constraint, done at once when it is cached)."""
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="tpe-grammar")
        future = self._executor.submit(self._compile, *key)
        future.add_done_callback(_stamp_finish)
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return future

    def _compile(self, kind: str, text: str) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
        return self._compiler.compile_grammar(_grammar(kind, text))

    def _build_compiler(self) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
        )
        return xgr.GrammarCompiler(info, max_threads=4)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _set_bit(bitmask: torch.Tensor, row: int, token: int) -> None:
    word, bit = divmod(token, 32)
    bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32 words


class Phase(enum.Enum):
    UNDECIDED = "undecided"  # the next token may open a thinking block or start the output
    THINKING = "thinking"  # unconstrained until `</think>`
    CONSTRAINED = "constrained"


class GrammarState:
    """One sequence's matcher and how far it has followed the sequence's output."""

    def __init__(
        self,
        compiled: Any,
        think_start_id: int | None = None,
        think_end_id: int | None = None,
        prompt_state: ThinkingState = ThinkingState.CLOSED,
    ) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self._think_start = think_start_id
        self._think_end = think_end_id
        if think_end_id is None or prompt_state is ThinkingState.CLOSED:
            self.phase = Phase.CONSTRAINED
        elif prompt_state is ThinkingState.OPEN or think_start_id is None:
            self.phase = Phase.THINKING
        else:
            self.phase = Phase.UNDECIDED
        # Output position where the constraint starts (None until known) and how many tokens
        # the matcher has accepted since.
        self._start: int | None = 0 if self.phase is Phase.CONSTRAINED else None
        self._accepted = 0
        self._past_end = 0  # stop tokens after the end (a sequence that ignores EOS)
        self._seen = 0  # output tokens looked at while not constrained

    @property
    def masks_next(self) -> bool:
        """Whether the next token is masked (every token but those of the thinking)."""
        return self.phase is not Phase.THINKING

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([R, ceil(V / 32)] int32)."""
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)
        self.amend(bitmask, row)

    def amend(self, bitmask: torch.Tensor, row: int) -> None:
        """What the matcher's fill leaves out: `<think>` while undecided, and the stop tokens
        once the constraint is complete and a stop token did not end the sequence (it ignores
        EOS): it may only stop again."""
        if self.phase is Phase.UNDECIDED:
            assert self._think_start is not None
            _set_bit(bitmask, row, self._think_start)
        elif self.matcher.is_terminated():
            bitmask[row] = 0
            for token in self.matcher.stop_token_ids:
                _set_bit(bitmask, row, token)

    def advance(self, token_ids: Sequence[int], num_prompt_tokens: int) -> bool:
        """Follow the sequence's output, `token_ids[num_prompt_tokens:]`; False if the matcher
        rejects one of its tokens (the sequence broke its constraint, which the mask makes
        impossible for sampled tokens)."""
        num_output = len(token_ids) - num_prompt_tokens
        if self._start is None and not self._find_start(token_ids, num_prompt_tokens):
            return True
        assert self._start is not None
        followed = self._start + self._accepted + self._past_end
        if num_output < followed:  # the output got shorter: follow it back
            back = followed - num_output
            past_end = min(back, self._past_end)
            self._past_end -= past_end
            self.matcher.rollback(min(back - past_end, self._accepted))
            self._accepted -= min(back - past_end, self._accepted)
            followed = self._start + self._accepted + self._past_end
        for position in range(num_prompt_tokens + followed, len(token_ids)):
            token = token_ids[position]
            if self.matcher.is_terminated():  # past the end (EOS ignored): it may only stop
                if token not in self.matcher.stop_token_ids:
                    return False
                self._past_end += 1
            elif self.matcher.accept_token(token):
                self._accepted += 1
            else:
                return False
        return True

    def _find_start(self, token_ids: Sequence[int], num_prompt_tokens: int) -> bool:
        """Settle where the constraint starts if the new output says; False while it cannot."""
        num_output = len(token_ids) - num_prompt_tokens
        if self.phase is Phase.UNDECIDED and num_output > 0:
            if token_ids[num_prompt_tokens] == self._think_start:
                self.phase = Phase.THINKING
            else:
                self.phase, self._start = Phase.CONSTRAINED, 0
                return True
        if self.phase is Phase.THINKING:
            for i in range(self._seen, num_output):
                if token_ids[num_prompt_tokens + i] == self._think_end:
                    self.phase, self._start = Phase.CONSTRAINED, i + 1
                    return True
            self._seen = num_output
        return False


_batch_matcher: Any = None


def fill_bitmasks(states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
    """`states[i].fill(bitmask, rows[i])` for every i; several rows on xgrammar's threads (its
    batched fill releases the GIL and splits the rows over up to 8 threads)."""
    global _batch_matcher
    if len(states) == 1:
        states[0].fill(bitmask, rows[0])
        return
    import xgrammar as xgr

    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
    live = [(s.matcher, row) for s, row in zip(states, rows, strict=True)]
    live = [(m, row) for m, row in live if not m.is_terminated()]
    if live:
        _batch_matcher.batch_fill_next_token_bitmask(
            [m for m, _ in live], bitmask, [row for _, row in live]
        )
    for state, row in zip(states, rows, strict=True):
        state.amend(bitmask, row)
