"""The thread governor: it keeps the faster count, probes at once when steps slow down, backs
off while the answer holds, and its runner sets the count before each step."""

from __future__ import annotations

import pytest
import torch

from nanoserve.core.model_runner import StepRunner
from nanoserve.core.step_layout import StepLayout
from nanoserve.platforms.cpu import threads as governor_module
from nanoserve.platforms.cpu.threads import (
    FIRST_PROBE_AFTER_STEPS,
    MAX_PROBE_INTERVAL_S,
    PROBE_STEPS,
    GovernedRunner,
    ThreadGovernor,
)

DECODE = StepLayout(input_ids=[1], positions=[5], query_lens=[1], seq_lens=[6], sample_rows=[0])
PREFILL = StepLayout(input_ids=[1, 2, 3], positions=[0, 1, 2], query_lens=[3], seq_lens=[3])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(governor: ThreadGovernor, clock: Clock, step_s: dict[int, float], num_steps: int):
    """Decode steps whose time depends only on the thread count; returns the counts used."""
    used = []
    for _ in range(num_steps):
        threads = governor.threads_for(DECODE)
        used.append(threads)
        clock.now += step_s[threads]
        governor.observe(DECODE, threads, step_s[threads])
    return used


def test_a_busy_core_makes_it_drop_to_the_faster_count_and_a_free_one_brings_it_back():
    clock = Clock()
    governor = ThreadGovernor(2, clock)
    run_steps(governor, clock, {1: 0.010, 2: 0.006}, 100)  # quiet: two threads are faster
    assert governor.threads == 2
    busy = {1: 0.011, 2: 0.200}  # a process took a core: the pair waits at every barrier
    used = run_steps(governor, clock, busy, 30)
    assert governor.threads == 1 and used[-10:] == [1] * 10
    assert used.count(2) <= 12  # the slowdown started a probe at once, not after an interval
    run_steps(governor, clock, {1: 0.010, 2: 0.006}, 2000)  # the core is free again
    assert governor.threads == 2


def test_a_stable_answer_is_probed_ever_less_often():
    clock = Clock()
    governor = ThreadGovernor(2, clock)
    used = run_steps(governor, clock, {1: 0.020, 2: 0.010}, 20_000)  # 200 s of decoding
    assert governor.interval_s == MAX_PROBE_INTERVAL_S
    probe_steps = used.count(1)  # the only steps at one thread are probes
    assert 0 < probe_steps < 0.01 * len(used)


def test_on_a_busy_core_probing_the_collapsed_count_costs_few_of_its_steps():
    """At one thread beside a hog, a step now and then runs slow (the scheduler's slices): that
    is no reason to try two threads, and a probe of two ends at its first collapsed step."""
    clock = Clock()
    governor = ThreadGovernor(2, clock)
    used = run_steps(governor, clock, {1: 0.010, 2: 0.200}, 40)
    assert governor.threads == 1
    before = used.count(2)
    used = []
    for step in range(3000):  # 30 s of decoding at one thread, every 10th step 3x slower
        threads = governor.threads_for(DECODE)
        used.append(threads)
        seconds = {1: 0.030 if step % 10 == 0 else 0.010, 2: 0.200}[threads]
        clock.now += seconds
        governor.observe(DECODE, threads, seconds)
    assert governor.threads == 1
    probes = 1 + 5  # the one soon after the switch, then at 2, 4, 8, 16 s ... within 30 s
    assert before <= 2 + 2 * (PROBE_STEPS - 1) + 2 and used.count(2) <= 2 * probes


def test_one_thread_never_probes_and_prefill_steps_are_not_timed():
    governor = ThreadGovernor(1, Clock())
    for _ in range(3 * FIRST_PROBE_AFTER_STEPS):
        governor.observe(DECODE, 1, 0.01)
        assert governor.threads_for(DECODE) == 1
    two = ThreadGovernor(2, Clock())
    for _ in range(3 * FIRST_PROBE_AFTER_STEPS):
        two.observe(PREFILL, 2, 1.0)
    assert two.num_decode_steps == 0 and not two.probe


class RecordingRunner(StepRunner):
    name = "recording"

    def __init__(self) -> None:
        super().__init__(torch.nn.Identity())
        self.threads: list[int] = []

    def run(self, layout: StepLayout) -> torch.Tensor:
        self.threads.append(torch.get_num_threads())
        return torch.zeros(len(layout.sample_rows), 4)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.threads.append(torch.get_num_threads())  # the LM head at the step's count too
        return hidden


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_runner_sets_the_count_before_each_step(restore_threads, monkeypatch):
    inner = RecordingRunner()
    governor = ThreadGovernor(2, Clock())
    runner = GovernedRunner([inner], governor)
    timed: list[tuple[int, float]] = []
    monkeypatch.setattr(governor, "observe", lambda layout, n, s: timed.append((n, s)))
    for threads in (1, 2):
        monkeypatch.setattr(governor, "threads_for", lambda layout, n=threads: n)
        hidden = runner.run(DECODE)
        assert len(timed) == threads - 1  # the step is timed once its logits are computed
        runner.logits(hidden)
        runner.logits(hidden)  # (a second product, as prompt logprobs take: not timed again)
    assert inner.threads == [1, 1, 1, 2, 2, 2]
    assert [n for n, _ in timed] == [1, 2]  # each step's time reached the governor once
    assert runner.name == "adaptive-threads(recording)"


def test_cpu_engines_adapt_unless_told_not_to(tmp_path, monkeypatch, restore_threads):
    from tiny_checkpoints import make_tiny_checkpoint

    from nanoserve.common.config import EngineConfig
    from nanoserve.engine_setup import build_engine

    config = EngineConfig(model=str(make_tiny_checkpoint(tmp_path)), device="cpu")
    torch.set_num_threads(2)
    runners = ["cpu-fused-decode", "eager"]  # a bf16 model; decode steps fused where they can
    governed = "adaptive-threads(" + ", ".join(runners) + ")"
    assert [r.name for r in build_engine(config).runner.step_runners] == [governed]
    monkeypatch.setenv("NANOSERVE_ADAPTIVE_THREADS", "0")
    assert [r.name for r in build_engine(config).runner.step_runners] == runners
    assert governor_module.PROBE_STEPS >= 2  # a probe's verdict is the best of several steps


def test_a_probe_of_a_slower_count_ends_after_one_timed_step():
    """On a quiet machine one thread of two is ~1.8x slower: a probe of it costs its warm-up
    step and one timed step, not PROBE_STEPS of them."""
    clock = Clock()
    governor = ThreadGovernor(2, clock)
    used = run_steps(governor, clock, {1: 0.018, 2: 0.010}, 40)  # the first probe comes early
    assert governor.threads == 2 and used.count(1) == 2


def test_a_step_that_gives_a_request_its_first_token_is_never_probed():
    """A keystroke's prompt after the prefix cache runs one token: a decode-shaped step whose
    time to first token must not be spent at the probed count."""
    from nanoserve.common.sampling_params import SamplingParams
    from nanoserve.core.request import Request

    fresh = Request("keystroke", [1, 2, 3], SamplingParams(max_tokens=4))
    first_token = StepLayout(
        input_ids=[3], positions=[2], query_lens=[1], seq_lens=[3], sample_rows=[0]
    )
    first_token.sampling_requests = [fresh]
    clock = Clock()
    governor = ThreadGovernor(2, clock)
    run_steps(governor, clock, {1: 0.010, 2: 0.006}, FIRST_PROBE_AFTER_STEPS + 1)
    assert governor.threads_for(DECODE) == 1  # the next decode step would run the probed count
    assert governor.threads_for(first_token) == 2
    governor.observe(first_token, 2, 0.5)
    assert governor.num_decode_steps == FIRST_PROBE_AFTER_STEPS + 1  # not timed either


def test_a_step_slowed_now_and_then_does_not_make_the_slower_count_win():
    """On a quiet machine something else (a kernel thread, a page fault) now and then slows a
    step of two threads to 2.5x: probes that catch such steps keep two threads."""
    clock = Clock()
    governor = ThreadGovernor(2, clock)
    used = []
    for step in range(3000):  # every third step slowed
        threads = governor.threads_for(DECODE)
        used.append(threads)
        seconds = {1: 0.037, 2: 0.050 if step % 3 == 0 else 0.020}[threads]
        clock.now += seconds
        governor.observe(DECODE, threads, seconds)
        assert governor.threads == 2
    assert used.count(1) < 0.01 * len(used)  # and one slow step alone starts no probe


def test_a_probe_goes_by_each_counts_fastest_step():
    clock = Clock()
    governor = ThreadGovernor(2, clock)
    governor.samples = {2: [0.050, 0.020, 0.060], 1: [0.037, 0.036, 0.038]}
    governor._decide()
    assert governor.threads == 2  # 36 ms is not 10% faster than 20 ms
    governor.samples = {2: [0.200, 0.180, 0.210], 1: [0.037, 0.090, 0.038]}
    governor._decide()
    assert governor.threads == 1  # a core taken for good: every step of two is slow
