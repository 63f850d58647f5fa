"""Speculative decoding: proposers (``ngram``, ``draft``) and verification by rejection sampling.

A step verifies, for each running request, its last token plus ``k`` proposed tokens in the
same forward pass as the other requests' tokens; ``rejection.verify_request`` keeps the
accepted prefix and adds one token from the target, so greedy output is exactly the target's
and sampled output has the target's distribution.

"Exactly" holds bit for bit in float32. In bfloat16 the target's logits depend on the shapes of
the step (a bf16 GEMM may round a row differently with the number of rows; a verified run of
1 + k tokens takes another attention path than a one-token decode), so a near tie may flip
between a speculative and a plain run, as it does between a cold and a warm prefix cache or with
prefix caching off. A speculative engine's steps that verify nothing run the plain engine's
forward and argmax, so they give its tokens exactly.
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
