"""What a step that verifies drafts costs here, relative to a plain decode step, from timings.

The speculator times every engine step whose requests were all decoding (from one `propose`
to the next: the proposer, the forward pass, the sampler or the rejection sampler, and what the
caller does with the tokens between steps; in a quiet spell, from one skipped `propose` to the
next: plain steps as they run without speculation's bookkeeping, which a verify step's time
includes). It tells `StepCosts` the step's shape and seconds:

    plain steps   (no drafts) by the number of decoding requests B
    verify steps  by the number of tokens they ran, T = B + D drafts

each bucket keeping the median of its last `WINDOW` times (a median: a step that a garbage
collection or another process stretched does not move it). `relative_costs(B, n)` then reads
the cost of a step of B requests verifying D = 0..n drafts in plain steps of B requests:

    cost(D) = verify_seconds(B + D) / plain_seconds(B),   cost(0) = 1

A verify bucket with fewer than `MIN_SAMPLES` times is not known yet: between known buckets
the time is interpolated; below the smallest, it is the smallest's (never cheaper than seen);
above the largest, it grows by `PRIOR_PER_DRAFT` plain steps a token. That guess is hopeful on
purpose: a step's cost often grows more slowly with more tokens (a CPU's matrix products change
method at some size; a GPU's are nearly flat), and a longer step that is never tried is never
timed. With no verify bucket known, `PRIOR_FIXED + PRIOR_PER_DRAFT * D`.
The proposer's calls are timed too (`lookup_cost`: per request, in plain steps).
Costs are asked for every step, and reading them off the buckets is a few dozen Python
operations: the answers are kept, and read afresh when a bucket becomes known and every
`REFRESH_STEPS` timed steps (so a median that moved, or a bucket gone stale, counts soon).
Times go stale: a bucket not timed in the last `MAX_AGE_STEPS` steps counts as not known
(its next time starts it afresh), since the machine's load moves and a shape once timed dear
would otherwise never be tried again. A batch size whose plain steps are not known asks for a
plain step (`needs_plain_step`); its costs are read from the nearest one known.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

WINDOW = 16  # the times each bucket keeps
MIN_SAMPLES = 3  # the times a bucket needs before it is trusted
MAX_AGE_STEPS = 256  # steps (timed ones, of any shape) after which a bucket's times are stale
PRIOR_FIXED = 0.1  # before any verify step is timed: its cost beyond a plain step ...
PRIOR_PER_DRAFT = 0.15  # ... and per draft (in plain steps; a 4-token step then costs 1.55)
REFRESH_STEPS = 8  # timed steps between readings of the costs off the buckets


class TimedBucket:
    """The last `WINDOW` times of one step shape, their median, and when the last came."""

    def __init__(self) -> None:
        self.seconds: deque[float] = deque(maxlen=WINDOW)
        self._median_s: float | None = 0.0  # None: to compute again (read less than added)
        self.last_step = 0

    def add(self, seconds: float, step: int) -> None:
        if step - self.last_step > MAX_AGE_STEPS:
            self.seconds.clear()  # stale: start afresh
        self.seconds.append(seconds)
        self._median_s = None
        self.last_step = step

    @property
    def median_s(self) -> float:
        if self._median_s is None:
            self._median_s = statistics.median(self.seconds)
        return self._median_s

    def is_known(self, step: int) -> bool:
        """Timed often enough, and lately (as of timed step number `step`)."""
        return len(self.seconds) >= MIN_SAMPLES and step - self.last_step <= MAX_AGE_STEPS


class StepCosts:
    """Running estimates of plain and verify step times on this machine (see above)."""

    def __init__(self) -> None:
        self.plain: dict[int, TimedBucket] = {}  # by decoding requests B
        self.verify: dict[int, TimedBucket] = {}  # by tokens run T = B + D
        self.lookup = TimedBucket()  # the proposer's calls, per request asked
        self.num_steps = 0  # steps timed so far: the buckets' clock
        self._costs: dict[tuple[int, int], list[float]] = {}  # (B, n): answers until refreshed
        self._lookup_costs: dict[int, float] = {}  # B: answers until refreshed

    def observe(self, num_requests: int, num_drafts: int, seconds: float) -> None:
        """A step of `num_requests` decoding requests verifying `num_drafts` drafts took
        `seconds`."""
        self.num_steps += 1
        if num_drafts:
            buckets, shape = self.verify, num_requests + num_drafts
        else:
            buckets, shape = self.plain, num_requests
        if shape not in buckets:  # (not setdefault: a bucket is made once, not per step)
            buckets[shape] = TimedBucket()
        bucket = buckets[shape]
        bucket.add(seconds, self.num_steps)
        if len(bucket.seconds) == MIN_SAMPLES or self.num_steps % REFRESH_STEPS == 0:
            self._forget_answers()

    def observe_lookup(self, num_requests: int, seconds: float) -> None:
        """The proposer took `seconds` to draft for `num_requests` requests."""
        self.lookup.add(seconds / num_requests, self.num_steps)
        if len(self.lookup.seconds) == MIN_SAMPLES:
            self._forget_answers()

    def _forget_answers(self) -> None:
        self._costs.clear()
        self._lookup_costs.clear()

    def lookup_cost(self, num_requests: int) -> float:
        """What asking the proposer for one request costs, in plain steps (0 until timed)."""
        if num_requests not in self._lookup_costs:
            plain_s = self._plain_seconds(num_requests)
            cost = 0.0
            if plain_s and self.lookup.is_known(self.num_steps):
                cost = self.lookup.median_s / plain_s
            self._lookup_costs[num_requests] = cost
        return self._lookup_costs[num_requests]

    def needs_plain_step(self, num_requests: int) -> bool:
        """True when plain steps of `num_requests` requests need (re)timing first."""
        bucket = self.plain.get(num_requests)
        return bucket is None or not bucket.is_known(self.num_steps)

    def relative_costs(self, num_requests: int, max_drafts: int) -> list[float]:
        """[max_drafts + 1]: the cost of a step verifying D drafts, in plain steps (a list
        kept until the next refresh: not to be changed)."""
        key = (num_requests, max_drafts)
        if key not in self._costs:
            self._costs[key] = self._read_costs(num_requests, max_drafts)
        return self._costs[key]

    def _read_costs(self, num_requests: int, max_drafts: int) -> list[float]:
        plain_s = self._plain_seconds(num_requests)
        known = sorted(t for t, bucket in self.verify.items() if bucket.is_known(self.num_steps))
        if plain_s is None or not known:
            return [1.0] + [1 + PRIOR_FIXED + PRIOR_PER_DRAFT * d for d in range(1, max_drafts + 1)]
        times = [self.verify[t].median_s for t in known]
        return [1.0] + [
            self._verify_seconds(num_requests + d, known, times, plain_s) / plain_s
            for d in range(1, max_drafts + 1)
        ]

    def _plain_seconds(self, num_requests: int) -> float | None:
        """The median plain step of `num_requests` requests, else of the nearest count timed."""
        known = [b for b, bucket in self.plain.items() if bucket.is_known(self.num_steps)]
        if not known:
            return None
        nearest = min(known, key=lambda b: (abs(b - num_requests), b))
        return self.plain[nearest].median_s

    @staticmethod
    def _verify_seconds(
        num_tokens: int, known: list[int], times: list[float], plain_s: float
    ) -> float:
        """A verify step of `num_tokens` tokens, read off the `known` buckets' `times`."""
        index = bisect.bisect_left(known, num_tokens)
        if index < len(known) and known[index] == num_tokens:
            return times[index]
        if index == 0:
            return times[0]
        if index == len(known):  # hopeful, so that it gets tried (and timed)
            return times[-1] + PRIOR_PER_DRAFT * plain_s * (num_tokens - known[-1])
        low, high = known[index - 1], known[index]
        share = (num_tokens - low) / (high - low)
        return times[index - 1] + share * (times[index] - times[index - 1])
