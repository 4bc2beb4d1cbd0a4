"""One request's grammar state: an llguidance matcher that has consumed every output token."""

from __future__ import annotations

import llguidance


class GrammarState:
    """The grammar of one constrained request, advanced with each token the engine accepts.

    The matcher has consumed exactly the request's output tokens. Preemption keeps those
    tokens (only their KV is recomputed), so it keeps this state too; an abort or finish drops
    it. Speculative decoding checks a draft with `count_valid` and undoes rejected tokens with
    `rollback`.
    """

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return self.matcher.consume_token(token_id)

    def count_valid(self, token_ids: list[int]) -> int:
        """How many leading tokens of a draft the grammar would accept (the state is unchanged)."""
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if not self.matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll the grammar back by {num_tokens} tokens")

    @property
    def is_complete(self) -> bool:
        """The output so far is a whole match: EOS is allowed now."""
        return self.matcher.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """Nothing but EOS can follow (or the matcher failed): the output is over."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """llguidance's reason once it refused a token (a limit it hit, a token it forbids)."""
        return self.matcher.get_error().split("\n<state>", 1)[0].strip()
