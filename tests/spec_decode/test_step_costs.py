"""StepCosts: plain and verify step times in, the cost of verifying D drafts in plain steps out."""

from __future__ import annotations

import pytest

from nanoserve.spec_decode.step_costs import (
    MAX_AGE_STEPS,
    MIN_SAMPLES,
    PRIOR_FIXED,
    PRIOR_PER_DRAFT,
    REFRESH_STEPS,
    WINDOW,
    StepCosts,
)


def observed(steps: list[tuple[int, int, float]], times: int = MIN_SAMPLES) -> StepCosts:
    """StepCosts that saw each (requests, drafts, seconds) step `times` times."""
    costs = StepCosts()
    for _ in range(times):
        for num_requests, num_drafts, seconds in steps:
            costs.observe(num_requests, num_drafts, seconds)
    return costs


def test_before_any_verify_step_is_timed_the_prior_is_used():
    costs = observed([(1, 0, 0.002)])
    assert costs.relative_costs(1, 2) == pytest.approx(
        [1.0, 1 + PRIOR_FIXED + PRIOR_PER_DRAFT, 1 + PRIOR_FIXED + 2 * PRIOR_PER_DRAFT]
    )


def test_plain_steps_are_timed_first_at_each_batch_size_and_again_when_stale():
    costs = observed([(1, 0, 1.0)], times=MIN_SAMPLES - 1)
    assert costs.needs_plain_step(1)
    costs.observe(1, 0, 1.0)
    assert not costs.needs_plain_step(1) and costs.needs_plain_step(2)
    for _ in range(MAX_AGE_STEPS):
        costs.observe(1, 3, 2.0)
    assert not costs.needs_plain_step(1)
    costs.observe(1, 3, 2.0)
    assert costs.needs_plain_step(1)  # MAX_AGE_STEPS timed steps since the last plain one
    costs.observe(1, 0, 1.0)
    assert costs.needs_plain_step(1)  # its old times are gone: MIN_SAMPLES new ones needed
    costs.observe(1, 0, 1.0)
    costs.observe(1, 0, 1.0)
    assert not costs.needs_plain_step(1)


def test_a_verify_step_timed_dear_long_ago_is_guessed_again_so_that_it_is_retried():
    costs = observed([(1, 0, 1.0), (1, 1, 1.2), (1, 3, 9.0)])  # 3 drafts once timed dear
    assert costs.relative_costs(1, 3)[3] == pytest.approx(9.0)
    for _ in range(MAX_AGE_STEPS // 2 + 1):
        costs.observe(1, 0, 1.0)
        costs.observe(1, 1, 1.2)
    assert costs.relative_costs(1, 3)[3] == pytest.approx(1.2 + 2 * PRIOR_PER_DRAFT)


def test_verify_costs_are_read_off_the_timed_buckets_in_plain_steps():
    # plain 1 s; 2 tokens (1 draft) 2.5 s; 4 tokens (3 drafts) 3.5 s; 5 tokens (4 drafts) 4.5 s
    costs = observed([(1, 0, 1.0), (1, 1, 2.5), (1, 3, 3.5), (1, 4, 4.5)])
    # D = 2 between the buckets; D = 5, 6 beyond the last: a hopeful PRIOR_PER_DRAFT a token
    beyond = [4.5 + PRIOR_PER_DRAFT, 4.5 + 2 * PRIOR_PER_DRAFT]
    assert costs.relative_costs(1, 6) == pytest.approx([1.0, 2.5, 3.0, 3.5, 4.5, *beyond])


def test_below_the_smallest_bucket_a_step_costs_what_that_one_does():
    costs = observed([(1, 0, 2.0), (1, 3, 5.0)])  # only 3 drafts timed: 2.5 plain steps
    beyond = 2.5 + PRIOR_PER_DRAFT
    assert costs.relative_costs(1, 4) == pytest.approx([1.0, 2.5, 2.5, 2.5, beyond])


def test_the_median_keeps_an_outlier_out():
    costs = observed([(1, 0, 1.0), (1, 1, 1.5)])
    costs.observe(1, 0, 50.0)  # a step another process held up
    costs.observe(1, 1, 80.0)
    assert costs.relative_costs(1, 1) == pytest.approx([1.0, 1.5])


def test_a_batch_size_not_timed_reads_the_nearest_one_timed():
    costs = observed([(1, 0, 1.0), (3, 0, 2.0), (3, 2, 3.0)])
    assert costs.relative_costs(2, 3)[3] == pytest.approx(3.0)  # 5 tokens over 1 s (B = 1)
    assert costs.relative_costs(4, 1)[1] == pytest.approx(1.5)  # 5 tokens over 2 s (B = 3)


def test_a_bucket_counts_as_soon_as_it_is_known():
    costs = observed([(1, 0, 1.0)])
    prior = [1.0, 1 + PRIOR_FIXED + PRIOR_PER_DRAFT]
    assert costs.relative_costs(1, 1) == pytest.approx(prior)
    for _ in range(MIN_SAMPLES):
        costs.observe(1, 1, 3.0)
    assert costs.relative_costs(1, 1) == pytest.approx([1.0, 3.0])


def test_a_median_that_moved_is_read_within_refresh_steps():
    costs = observed([(1, 0, 1.0), (1, 1, 1.5)])
    assert costs.relative_costs(1, 1) == pytest.approx([1.0, 1.5])
    for _ in range(WINDOW):  # the machine got busy: verify steps now take 3 s
        costs.observe(1, 1, 3.0)
    assert costs.relative_costs(1, 1) == pytest.approx([1.0, 3.0])
    for _ in range(REFRESH_STEPS):
        costs.observe(1, 0, 2.0)
        costs.observe(1, 0, 2.0)
    assert costs.relative_costs(1, 1) == pytest.approx([1.0, 1.5])  # and plain ones 2 s
