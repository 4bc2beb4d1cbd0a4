"""How many compute threads a CPU worker's steps use, chosen by timing them.

A CPU worker starts with a thread per core it was given. When another process takes one of
those cores, every op's OpenMP team waits at its barrier for the thread that has no core, over
and over within one step: on a 2-core machine with one busy core, two threads decoded tens of
times slower than one (benchmarks/RESULTS.md). The cores a worker can use change while it runs,
so the count is measured, not guessed: `ThreadGovernor` times the decode steps and now and then
runs a few of them at a neighbouring count, interleaved with the current one; the faster count
wins. A probe starts at once, toward fewer threads, when the current count's steps suddenly slow
down, two in a row (a process took a core), and otherwise at intervals that grow while the
answer stays the same; a probe ends at the first timed step of the other count that is plainly
slower than usual, since on a busy core each such step costs many ordinary ones. A step that
gives a request its first token is never probed (nor timed): after the prefix cache an editor's
next keystroke is a one-token step, and its time to first token must not be the one run at the
slower count.

`GovernedRunner` is the step runner that applies it: it sets the count (`torch.set_num_threads`,
which the C++ kernels' OpenMP regions and oneDNN share) before each step and reports the step's
time, up to the end of its LM head's product (a large part of a small model's step, and as
sensitive to the count as the layers). A probe's verdict goes by each count's fastest step:
a kernel thread or a page fault now and then slows a step of two threads down, and a
median of three such steps once made one thread look faster on a quiet machine.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from nanoserve.core.model_runner import StepRunner
from nanoserve.core.step_layout import StepLayout

logger = logging.getLogger("nanoserve.threads")

PROBE_STEPS = 3  # decode steps timed at each count in one probe (after one that warms it)
FIRST_PROBE_AFTER_STEPS = 4  # early: a machine busy from the start shows no slowdown
MIN_PROBE_INTERVAL_S = 1.0
MAX_PROBE_INTERVAL_S = 16.0
SWITCH_MARGIN = 0.9  # another count must be this much faster (its fastest step) to win
SLOWDOWN_FACTOR = 2.0  # current steps this much slower than usual start a probe at once,
SLOW_STEPS_TO_PROBE = 2  # this many in a row (one alone is more often a fault than a lost core)
GIVE_UP_FACTOR = 1.5  # a probed count's step this much slower than usual ends the probe
BASELINE_STEPS = 8  # recent steps at the current count that make "usual"


def is_timed(layout: StepLayout) -> bool:
    """Decode steps are timed and compared; not those that verify drafts (they run more
    tokens by design, and would look like a core lost to another process), nor a one-token
    prompt's (a first token is waited for)."""
    is_first_token = any(not r.output_token_ids for r in layout.sampling_requests)
    return layout.is_decode_only and not any(layout.draft_token_ids) and not is_first_token


class ThreadGovernor:
    """Picks the thread count of the next step from the times of the last ones (see above)."""

    def __init__(self, max_threads: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self.clock = clock
        self.interval_s = MIN_PROBE_INTERVAL_S
        self.next_probe_at = float("inf")  # set after the first decode steps
        self.num_decode_steps = 0
        self.recent: list[float] = []  # seconds of the last decode steps at the current count
        self.slow_steps = 0  # the last steps in a row that were much slower than usual
        self.probe: list[int] = []  # the counts of the probe's remaining steps, in order
        self.samples: dict[int, list[float]] = {}  # the probe's step times by count

    def threads_for(self, layout: StepLayout) -> int:
        """The count to run this step with."""
        if self.probe and is_timed(layout):
            return self.probe[0]
        return self.threads

    def observe(self, layout: StepLayout, threads: int, seconds: float) -> None:
        """A step ran at `threads` in `seconds`; only decode steps are compared."""
        if not is_timed(layout) or self.max_threads == 1:
            return
        self.num_decode_steps += 1
        if self.probe:
            self._record_probe(threads, seconds)
            return
        is_slow = (
            len(self.recent) >= BASELINE_STEPS and seconds > SLOWDOWN_FACTOR * self._usual_step()
        )
        self.slow_steps = self.slow_steps + 1 if is_slow else 0
        self.recent = [*self.recent, seconds][-BASELINE_STEPS:]
        if self.num_decode_steps == FIRST_PROBE_AFTER_STEPS:
            self.next_probe_at = self.clock()
        if self.slow_steps >= SLOW_STEPS_TO_PROBE and self.threads > 1:  # fewer cores now?
            self.slow_steps, self.recent = 0, []  # what was usual may be no longer
            self._start_probe(self.threads - 1)
            self.interval_s = MIN_PROBE_INTERVAL_S
        elif self.clock() >= self.next_probe_at:
            self._start_probe(self._neighbour())

    def _neighbour(self) -> int:
        """One count away from the current one, alternating down and up where both exist."""
        counts = [n for n in (self.threads - 1, self.threads + 1) if 1 <= n <= self.max_threads]
        return counts[self.num_decode_steps % len(counts)]

    def _start_probe(self, other: int) -> None:
        """Interleave steps at the current count and at `other`; the first of each warms."""
        self.probe = [self.threads, other] * (PROBE_STEPS + 1)
        self.samples = {self.threads: [], other: []}

    def _usual_step(self) -> float:
        """Seconds of the current count's usual decode step (none known yet: infinity)."""
        return statistics.median(self.recent) if self.recent else float("inf")

    def _record_probe(self, threads: int, seconds: float) -> None:
        expected = self.probe.pop(0)
        if threads == expected and len(self.probe) < 2 * PROBE_STEPS:  # past the warm-up pair
            self.samples[threads].append(seconds)
            if threads != self.threads and seconds > GIVE_UP_FACTOR * self._usual_step():
                self.probe = []  # plainly slower (a pair on one free core): no more such steps
        if not self.probe:
            self._decide()

    def _decide(self) -> None:
        """The count whose fastest step is faster by the margin wins: something else on the
        machine (a kernel thread, a page fault) only ever slows a step down, so each count's
        fastest step is its own speed, while a core taken for good slows them all. The current
        count's usual step counts too (unless a slowdown started the probe)."""
        current, other = self.samples
        current_s = min([*self.samples[current], self._usual_step()])
        other_s = min(self.samples[other] or [float("inf")])
        if other_s < SWITCH_MARGIN * current_s:
            logger.info(
                "compute threads %d -> %d (a decode step %.1f -> %.1f ms)",
                current,
                other,
                current_s * 1e3,
                other_s * 1e3,
            )
            self.threads, self.recent = other, []
            self.interval_s = MIN_PROBE_INTERVAL_S  # look again soon: one more may be better
        else:
            self.interval_s = min(MAX_PROBE_INTERVAL_S, 2 * self.interval_s)
        self.next_probe_at = self.clock() + self.interval_s


class GovernedRunner(StepRunner):
    """Runs each step with the governor's thread count, through the first of `runners` that
    can run it, and tells the governor how long it took."""

    name = "adaptive-threads"

    def __init__(self, runners: list[StepRunner], governor: ThreadGovernor) -> None:
        super().__init__(runners[-1].model)
        self.runners = runners
        self.governor = governor
        self._current = runners[-1]
        self._step: tuple[StepLayout, int, float] | None = None  # run, its logits not yet
        self.name = "adaptive-threads(" + ", ".join(r.name for r in runners) + ")"

    def run(self, layout: StepLayout) -> torch.Tensor:  # [S + P, hidden]
        threads = self.governor.threads_for(layout)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self._current = next(r for r in self.runners if r.can_run(layout))
        self._step = (layout, threads, time.perf_counter())
        return self._current.run(layout)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's product, at the step's count too: the step is timed up to its end."""
        logits = self._current.logits(hidden)
        if self._step is not None:
            layout, threads, started = self._step
            self.governor.observe(layout, threads, time.perf_counter() - started)
            self._step = None
        return logits

    def close(self) -> None:
        for runner in self.runners:
            runner.close()
