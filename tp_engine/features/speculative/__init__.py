"""Speculative decoding: a proposer guesses each decoding sequence's next tokens, and the target
model checks them all in one forward pass (see `tp_engine.core.spec_verify`). The proposers:
`ngram` (lookup in the sequence's own tokens), `draft_model` (a smaller model on the same
ranks; import it from `tp_engine.features.speculative.draft_model`, which needs the plan builder)
and `eagle3` (an EAGLE-3 head fed by the target's hidden states, `...speculative.eagle3`).
`plug_in` hands the core the proposer its config names; the verification rule and the counters
are the step pipeline's (`tp_engine.core.spec_verify`, `tp_engine.core.spec_metrics`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tp_engine.config.speculative import SpeculativeConfig
from tp_engine.core.spec_metrics import SpecDecodeStats
from tp_engine.core.spec_verify import Verdict, accept_drafts
from tp_engine.features.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from tp_engine.core.hooks import CoreHooks

__all__ = [
    "NgramProposer",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "Verdict",
    "accept_drafts",
    "plug_in",
]


def plug_in(spec: SpeculativeConfig, hooks: CoreHooks) -> None:
    """Give the core the proposer `spec` names (`CoreHooks.build_proposer`): n-gram lookup, or a
    draft model or EAGLE-3 head whose forward passes the core runs on every rank."""

    def build(run_draft_plan: Callable[..., Any], may_draft: Callable[..., Any]) -> Any:
        k = spec.num_speculative_tokens
        if spec.method == "draft_model":
            from tp_engine.features.speculative.draft_model import DraftModelProposer

            return DraftModelProposer(k, run_draft_plan, may_draft=may_draft)
        if spec.method == "eagle3":
            from tp_engine.features.speculative.eagle3 import Eagle3Proposer

            return Eagle3Proposer(k, run_draft_plan, may_draft=may_draft)
        return NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max, may_draft=may_draft)

    hooks.build_proposer = build
