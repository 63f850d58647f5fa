"""Speculative decoding: proposers (``ngram``, ``draft``) and verification by rejection sampling.

A step verifies, for each running request, its last token plus ``k`` proposed tokens in the
same forward pass as the other requests' tokens; ``rejection.verify_request`` keeps the
accepted prefix and adds one token from the target, so greedy output is exactly the target's
and sampled output has the target's distribution.
"""

from engine.spec_decode.draft import DraftProposer, check_same_tokenizer, find_distilled_draft
from engine.spec_decode.ngram import NgramCorpus, NgramProposer
from engine.spec_decode.proposer import Proposal, Proposer
from engine.spec_decode.rejection import VerifyResult, rejection_sample, verify_greedy, verify_request

__all__ = [
    "DraftProposer",
    "NgramCorpus",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "VerifyResult",
    "check_same_tokenizer",
    "find_distilled_draft",
    "rejection_sample",
    "verify_greedy",
    "verify_request",
]
