"""Step costs pinned for tests of verification (not of when to draft): a verify step costs what
a plain one does and the proposer nothing, whatever the clock says, so every request drafts
every step it may."""

from __future__ import annotations

from nanoserve.core.engine import Engine
from nanoserve.spec_decode.speculator import AdaptiveSpeculator
from nanoserve.spec_decode.step_costs import StepCosts


class FreeVerifySteps(StepCosts):
    """Verifying and proposing drafts cost nothing; timings are ignored."""

    def observe(self, num_requests: int, num_drafts: int, seconds: float) -> None:
        pass

    def needs_plain_step(self, num_requests: int) -> bool:
        return False

    def relative_costs(self, num_requests: int, max_drafts: int) -> list[float]:
        return [1.0] * (max_drafts + 1)

    def lookup_cost(self, num_requests: int) -> float:
        return 0.0


def pin_free_verify_steps(engine: Engine) -> None:
    """Give `engine`'s speculator (if it drafts) free verify steps."""
    if isinstance(engine.speculator, AdaptiveSpeculator):
        engine.speculator.costs = FreeVerifySteps()
