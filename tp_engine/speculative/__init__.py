"""Speculative decoding: a proposer guesses each decoding sequence's next tokens, and the target
model checks them all in one forward pass (see `tp_engine.speculative.verify`)."""

from tp_engine.speculative.config import SpeculativeConfig
from tp_engine.speculative.metrics import SpecDecodeStats
from tp_engine.speculative.ngram import NgramProposer
from tp_engine.speculative.verify import Verdict, accept_drafts

__all__ = ["NgramProposer", "SpecDecodeStats", "SpeculativeConfig", "Verdict", "accept_drafts"]
