"""Speculative decoding: a proposer guesses each decoding sequence's next tokens, and the target
model checks them all in one forward pass (see `tp_engine.features.speculative.verify`). The proposers:
`ngram` (lookup in the sequence's own tokens) and `draft_model` (a smaller model on the same
ranks; import it from `tp_engine.features.speculative.draft_model`, which needs the plan builder)."""

from tp_engine.features.speculative.config import SpeculativeConfig
from tp_engine.features.speculative.metrics import SpecDecodeStats
from tp_engine.features.speculative.ngram import NgramProposer
from tp_engine.features.speculative.verify import Verdict, accept_drafts

__all__ = ["NgramProposer", "SpecDecodeStats", "SpeculativeConfig", "Verdict", "accept_drafts"]
