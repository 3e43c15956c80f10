"""Logits processors: every per-row change of the logits before sampling, one interface.

A processor keeps its own state for the rows of the running batch that ask for it, and nothing
for the others. The sampling builder forwards it the batch's row events (a sequence takes a
row: `add_row`; gives it back: `remove_row`), so a processor decides once, when a sequence
starts running, whether that row asks; each step it says which of the step's rows ask
(`asking`: the sampler copies those rows alone, as float32, and edits the copy) and makes their
edit (`edit`, addressed to the copy's rows), from its state and, where it depends on them, its
sequences' tokens so far (read on the host for its rows only: bad words, min_tokens, the
thinking budget; penalties read only the tokens new since their last step). A processor with
no rows costs a truth test per step; the edits' tensors cover their own rows only
(`tp_engine.core.sampling.edits`).

One module per family: `base` (the interface: `LogitsProcessor`, `Tensors`, `DraftsAhead`),
`token_rules` (the sampling params' token rules: allowed tokens, bad words, min_tokens, logit
bias), `penalties` (and their token counts on the device), `constraints` (a grammar's mask, a
spent thinking budget's forced token); `builtin_processors` here puts them in order.

Order, as vLLM's sampler (allowed_token_ids, bad_words, then the processors that can move the
argmax: min_tokens, logit_bias; then penalties), with structured-output masks and the forced
end of thinking after them:

    AllowedTokens  BadWords  MinTokens  LogitBias  Penalties  GrammarMasks  ThinkingBudget

The masks set tokens to -inf, which biases and penalties leave at -inf, so where a mask sits
among them changes no result; the forced token overrides everything and so comes last.
"""

from __future__ import annotations

from collections.abc import Iterable

from tp_engine.core.sampling.processors.base import DraftsAhead, LogitsProcessor, Tensors
from tp_engine.core.sampling.processors.constraints import GrammarMasks, ThinkingBudget
from tp_engine.core.sampling.processors.penalties import Penalties, TokenCounts
from tp_engine.core.sampling.processors.token_rules import (
    AllowedTokens,
    BadWords,
    LogitBias,
    MinTokens,
)

__all__ = [
    "AllowedTokens",
    "BadWords",
    "DraftsAhead",
    "GrammarMasks",
    "LogitBias",
    "LogitsProcessor",
    "MinTokens",
    "Penalties",
    "Tensors",
    "ThinkingBudget",
    "TokenCounts",
    "builtin_processors",
]


def builtin_processors(tensors: Tensors, eos_token_ids: Iterable[int]) -> list[LogitsProcessor]:
    """The engine's processors, in the order they apply (see the package docstring)."""
    return [
        AllowedTokens(tensors),
        BadWords(tensors),
        MinTokens(tensors, eos_token_ids),
        LogitBias(tensors),
        Penalties(tensors),
        GrammarMasks(tensors),
        ThinkingBudget(tensors),
    ]
