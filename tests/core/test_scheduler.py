"""The scheduler on its own: budgets, chunking, preemption, abort, and a randomized soak."""

import random

from nanoserve.common.config import SchedulerConfig
from nanoserve.common.protocol import FinishReason
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.kv_cache_manager import KVCacheManager
from nanoserve.core.request import Request, RequestStatus
from nanoserve.core.scheduler import Scheduler

EOS = 0


def make_scheduler(
    num_blocks=16, block_size=4, max_num_seqs=4, budget=64, max_model_len=64, prefix_caching=True
):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching))


def add(scheduler, request_id, num_prompt, max_tokens=4, first_token=1):
    prompt = [first_token + i for i in range(num_prompt)]
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), frozenset({EOS}))
    scheduler.add_request(request)
    return request


def run_step(scheduler, token=7):
    """One schedule/update round that 'samples' `token` for every request that samples."""
    out = scheduler.schedule()
    sampled = {
        r.request_id: [token]
        for r in out.requests
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
    }
    deltas = scheduler.update(out, sampled, {})
    return out, deltas


def test_prefill_then_decode_one_token_per_step():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 6, max_tokens=3)
    out, deltas = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 6}
    assert request.block_ids == [0, 1]
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1}
    out, deltas = run_step(scheduler)
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert request.status == RequestStatus.FINISHED
    assert scheduler.kv.num_free_blocks == 16


def test_max_num_seqs_and_token_budget_limit_admission():
    scheduler = make_scheduler(max_num_seqs=2, budget=10)
    for name in "abc":
        add(scheduler, name, 4)
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}  # c waits: max_num_seqs
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_long_prompt_is_chunked_beside_decodes():
    scheduler = make_scheduler(budget=8, max_model_len=64)
    add(scheduler, "short", 3, max_tokens=10)
    run_step(scheduler)
    add(scheduler, "long", 20)
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}  # decodes first, then a chunk
    out, deltas = run_step(scheduler)
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    assert [d.request_id for d in deltas] == ["short"]  # no token for a mid-prompt chunk
    out, deltas = run_step(scheduler)
    assert out.num_scheduled_tokens == {"short": 1, "long": 6}
    assert [d.request_id for d in deltas] == ["short", "long"]


def test_preempts_newest_when_blocks_run_out_and_recomputes_it_later():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, prefix_caching=False)
    old = add(scheduler, "old", 7, max_tokens=8)
    new = add(scheduler, "new", 7, max_tokens=8)
    run_step(scheduler)  # both prefill: 2 blocks each, pool full
    assert scheduler.kv.num_free_blocks == 0
    run_step(scheduler)  # both reach 8 tokens: still fit
    out, _ = run_step(scheduler)  # old needs a 3rd block: the newest is preempted
    assert out.preempted_ids == ["new"]
    assert new.status == RequestStatus.PREEMPTED and new.block_ids == []
    assert list(scheduler.waiting) == [new]
    assert scheduler.num_preemptions_total == 1
    while old.status != RequestStatus.FINISHED:
        run_step(scheduler)
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"new": 9}  # prompt + 2 outputs recomputed at once


def test_abort_in_every_state_returns_all_blocks():
    scheduler = make_scheduler(budget=6)
    running = add(scheduler, "running", 5)
    chunked = add(scheduler, "chunked", 12, first_token=100)
    run_step(scheduler)
    waiting = add(scheduler, "waiting", 3)
    assert chunked.num_computed_tokens == 1 and running.status == RequestStatus.RUNNING
    scheduler.abort(["running", "chunked", "waiting", "unknown"])
    assert scheduler.kv.num_free_blocks == 16
    assert scheduler.num_unfinished == 0
    assert waiting.finish_reason == FinishReason.ABORT
    scheduler.kv.pool.check_invariants()


def test_eos_min_tokens_and_stop_token_ids():
    scheduler = make_scheduler()
    request = Request(
        "a",
        [1, 2],
        SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[9]),
        frozenset({EOS}),
    )
    scheduler.add_request(request)
    _, deltas = run_step(scheduler, token=EOS)
    assert deltas[0].finish_reason is None  # min_tokens not reached
    _, deltas = run_step(scheduler, token=9)
    assert deltas[0].finish_reason == FinishReason.STOP and deltas[0].stop_reason == 9


def test_context_limit_finishes_with_length():
    scheduler = make_scheduler(max_model_len=8)
    request = add(scheduler, "a", 6, max_tokens=None)
    run_step(scheduler)
    _, deltas = run_step(scheduler)
    assert deltas[0].finish_reason == FinishReason.LENGTH and request.num_tokens == 8


def test_randomized_soak_keeps_pool_invariants():
    """Thousands of steps of random arrivals, aborts and overlapping prompts."""
    for seed in range(3):
        rng = random.Random(seed)
        scheduler = make_scheduler(
            num_blocks=24, block_size=4, max_num_seqs=6, budget=24, max_model_len=48
        )
        prefixes = [[rng.randrange(1, 50) for _ in range(20)] for _ in range(3)]
        next_id = 0
        for _ in range(1500):
            if rng.random() < 0.3:
                length = rng.randrange(1, 30)
                prompt = (rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(30)])[:length]
                request = Request(
                    str(next_id),
                    prompt,
                    SamplingParams(max_tokens=rng.randrange(1, 12)),
                    frozenset({EOS}),
                )
                scheduler.add_request(request)
                next_id += 1
            if scheduler.requests and rng.random() < 0.1:
                scheduler.abort([rng.choice(list(scheduler.requests))])
            out = scheduler.schedule()
            assert sum(out.num_scheduled_tokens.values()) <= 24 and len(scheduler.running) <= 6
            sampled = {
                r.request_id: [rng.randrange(0, 50)]
                for r in out.requests
                if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
            }
            scheduler.update(out, sampled, {})
            check_scheduler_invariants(scheduler)
        scheduler.abort(list(scheduler.requests))
        assert scheduler.kv.num_free_blocks == 24


def check_scheduler_invariants(scheduler):
    kv = scheduler.kv
    kv.pool.check_invariants()
    refs = [0] * kv.pool.num_blocks
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        assert len(request.block_ids) >= -(-request.num_computed_tokens // kv.block_size)
        for block_id in request.block_ids:
            refs[block_id] += 1
    for request in scheduler.waiting:
        assert request.block_ids == [] and request.num_computed_tokens == 0
    assert refs == [b.ref_count for b in kv.pool.blocks]
    # A cached block holds the tokens its hash names, for every request that uses it.
    for request in scheduler.running:
        hashes = kv._hashes_for(request)
        for i in range(request.num_computed_tokens // kv.block_size):
            block = kv.pool.blocks[request.block_ids[i]]
            if block.block_hash is not None:
                assert block.block_hash == hashes[i]
