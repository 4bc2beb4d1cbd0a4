"""How structured output enters the core: the grammar a constrained request carries, the backend
that builds grammars, and the masks the sampler applies.

The core knows no grammar engine. A backend (`nanoserve/structured_output`: llguidance) builds
each constrained request's `Grammar` off the step loop (the scheduler admits the request once it
is built) and, while a step's forward pass runs, fills the masks of the step's constrained rows
(`GrammarMasks`), which the sampler adds to their logits. The scheduler advances each grammar
by the tokens the request accepts."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from nanoserve.common.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from nanoserve.core.request import Request


class Grammar(Protocol):
    """One constrained request's grammar state, advanced with each token the engine accepts."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        ...

    def count_valid(self, token_ids: list[int]) -> int:
        """How many leading tokens of a draft it would accept (its state is unchanged)."""
        ...

    @property
    def is_terminated(self) -> bool:
        """Nothing but EOS can follow: the output is over."""
        ...

    @property
    def error(self) -> str:
        """Why it refused the last token: the request ends with this error (not as output)."""


@dataclass
class GrammarMasks:
    """One step's masks: which batch rows are constrained, and what to add to their logits."""

    rows: list[int]  # [G]: sampling rows with a grammar (a request's last token, its drafts)
    bias: torch.Tensor  # [G, V] float32: 0 where the grammar allows the token, -inf elsewhere


class GrammarBackend(Protocol):
    """Builds grammars and fills masks, both off the step loop."""

    def compile(self, constraint: StructuredOutputsParams) -> Future[Grammar]:
        """Start building `constraint`'s grammar; the future fails with a ValueError saying why."""
        ...

    def start_masks(
        self, requests: list[Request], draft_token_ids: list[list[int]]
    ) -> Future[GrammarMasks] | None:
        """Start filling the masks of the constrained `requests` (a step's sampling requests):
        one row at the request's state, then one after each of its drafts."""
        ...

    def shutdown(self) -> None: ...


class NoGrammarBackend:
    """Refuses every constrained request, saying why (the engine was built without a backend);
    so no request ever has a grammar, and no step has masks."""

    def __init__(self, reason: str = "structured output is not available in this engine") -> None:
        self.reason = reason

    def compile(self, constraint: StructuredOutputsParams) -> Future[Grammar]:
        refused: Future[Grammar] = Future()
        refused.set_exception(ValueError(self.reason))
        return refused

    def start_masks(self, requests: list[Request], drafts: list[list[int]]) -> None:
        return None

    def shutdown(self) -> None: ...


def apply_grammar_masks(logits: torch.Tensor, masks: GrammarMasks) -> torch.Tensor:
    """Set every token the grammar forbids to -inf, in the constrained rows (in place)."""
    # logits: [B, V]; masks.bias: [G, V]
    bias = masks.bias.to(logits.device, non_blocking=True)
    if len(masks.rows) == logits.shape[0]:  # every row is constrained
        return logits.add_(bias)
    rows = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)  # [G]
    return logits.index_add_(0, rows, bias)
