"""Speculative decoding, a plug-in: drafts proposed cheaply, verified by the target in one pass.

speculator.py         AdaptiveSpeculator: the core's Speculator; when to draft, metrics
step_costs.py         what a verify step costs here, in plain steps, from timed steps
rejection_sampler.py  which drafts the target accepts, keeping its distribution
ngram.py              prompt lookup: what followed the last match of the recent tokens
suffix.py             suffix decoding: counted continuations in suffix tries
draft_model.py        a smaller model with the same tokenizer, in its own engine
"""

from __future__ import annotations

import torch

from nanoserve.common.config import EngineConfig
from nanoserve.core.sampler import SamplerOps
from nanoserve.spec_decode.rejection_sampler import RejectionSampler
from nanoserve.spec_decode.speculator import AdaptiveSpeculator, Proposer
from nanoserve.spec_decode.suffix import TrieKinds


def build_speculator(
    config: EngineConfig,
    device: torch.device,
    vocab_size: int,
    max_model_len: int,
    sampler_ops: SamplerOps | None = None,
    suffix_tries: TrieKinds | None = None,
) -> AdaptiveSpeculator:
    """The speculator `config.speculative_config` asks for (it must be set); `sampler_ops`:
    the rejection sampler's (the platform's, as the engine's sampler has); `suffix_tries`:
    what suffix decoding's tries are made of (the platform's, if it has its own)."""
    spec = config.speculative_config
    assert spec is not None
    proposer: Proposer
    if spec.method == "ngram":
        from nanoserve.spec_decode.ngram import NgramProposer

        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "suffix":
        from nanoserve.spec_decode.suffix import SuffixProposer

        proposer = SuffixProposer(
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob,
            suffix_tries or TrieKinds(),
        )
    else:
        from nanoserve.spec_decode.draft_model import DraftModelProposer

        assert spec.model is not None
        proposer = DraftModelProposer.build(config, spec.model, vocab_size, max_model_len)
    return AdaptiveSpeculator(proposer, spec, rejection_sampler=RejectionSampler(sampler_ops))
