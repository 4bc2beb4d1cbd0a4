"""Workloads: autocomplete's debounced typing, per-round prompts pooled in order, the sweep's
prompt lengths."""

from __future__ import annotations

from pathlib import Path

import nanoserve
from nanoserve.bench.workloads import (
    Phase,
    PromptMaker,
    Workload,
    autocomplete,
    for_round,
    pooled,
    sweep,
)

DEMO_MODEL = Path(nanoserve.__file__).parent / "assets" / "demo"  # its tokenizer


def test_autocomplete_debounce_and_prefixes(tmp_path):
    source = tmp_path / "f.py"
    source.write_text("def f(x):\n    return x + 1\n" * 4)
    slow = autocomplete(source, 10, 20, typing_cps=5.0, debounce_ms=50, max_tokens=10, seed=0)
    fast = autocomplete(source, 10, 20, typing_cps=5.0, debounce_ms=500, max_tokens=10, seed=0)
    (phase,) = slow.phases
    # At 5 chars/s every gap is ≥ 100 ms, so a 50 ms debounce fires after every keystroke.
    assert len(phase.prompts) == 20
    assert phase.prompts[0] == source.read_text()[:11]
    assert all(b.startswith(a) for a, b in zip(phase.prompts, phase.prompts[1:], strict=False))
    assert phase.send_times_s == sorted(phase.send_times_s)
    # A 500 ms debounce only fires at pauses (after newlines) and after the last keystroke.
    assert 1 <= len(fast.phases[0].prompts) < 20
    assert fast.phases[0].prompts[-1] == source.read_text()[:30]


def test_rounds_salt_every_prompt_and_pool_in_order():
    """Each round's prompts start with words of their own; pooling keeps groups apart."""
    base = Workload(
        "shared-prefix",
        [Phase("c=1", ["system. q1", "system. q2", "other. q3"], 4, groups=[0, 0, 1])],
        {},
    )
    rounds = [for_round(base, index) for index in range(3)]
    first_words = {w.phases[0].prompts[0].split(".")[0] for w in rounds}
    assert len(first_words) == 3  # no prompt of one round prefixes one of another
    assert all(w.phases[0].prompts[0].endswith("system. q1") for w in rounds)
    assert base.phases[0].prompts == ["system. q1", "system. q2", "other. q3"]  # not mutated
    merged = pooled(rounds).phases[0]
    assert merged.prompts == [p for w in rounds for p in w.phases[0].prompts]
    assert merged.groups == [0, 0, 1, 2, 2, 3, 4, 4, 5]


def test_sweep_prompt_lengths_vary_within_the_range_ratio_as_vllm_bench_draws_them():
    maker = PromptMaker(DEMO_MODEL, seed=0)
    fixed = sweep(maker, [1], 60, 4, num_prompts=8, request_rate=float("inf"))
    assert {maker.num_tokens(p) for p in fixed.phases[0].prompts} == {60}
    varied = sweep(maker, [1], 60, 4, num_prompts=16, request_rate=float("inf"), range_ratio=0.5)
    lengths = [maker.num_tokens(p) for p in varied.phases[0].prompts]
    assert all(30 <= n <= 90 for n in lengths)
    assert len(set(lengths)) > 4  # drawn, not one length
    assert varied.params["random_range_ratio"] == 0.5
