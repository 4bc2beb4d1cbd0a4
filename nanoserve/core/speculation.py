"""How speculative decoding enters the core: a Speculator drafts tokens, then verifies them.

The core only makes room for drafts. After each step the speculator may give a decoding
request `spec_token_ids`; the scheduler runs them as extra tokens of its next step, the layout
puts them behind its last known token, and the model gives logits at each of those positions
(one forward pass for all of them). `verify` then says which drafts the target model accepts,
and the one token it samples after them (`nanoserve/spec_decode` is the plug-in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanoserve.common.protocol import SpecDecodeStats, TokenLogprobs

if TYPE_CHECKING:
    import torch

    from nanoserve.core.request import Request
    from nanoserve.core.sampling_batch import SamplingBatch

# Per request: the tokens to append (accepted drafts, then one sampled token), and their logprobs.
Verified = tuple[list[list[int]], list[list[TokenLogprobs] | None]]


class Speculator:
    """Proposes draft tokens for running requests and verifies them; this base drafts none."""

    def propose(self, requests: list[Request]) -> None:
        """Set `spec_token_ids` of the running requests to draft for in the next step."""

    def verify(
        self, logits: torch.Tensor, batch: SamplingBatch, draft_token_ids: list[list[int]]
    ) -> Verified:
        """logits [S + D, V]: per request, the rows of its last token then of each draft."""
        raise NotImplementedError("a speculator that drafts must verify")

    def stats(self) -> SpecDecodeStats | None:
        return None

    def close(self) -> None:
        """Release what drafting holds (a draft model's engine)."""
