"""Prefix caching and chunked prefill through the whole engine, with transformers as the oracle."""

import pytest
import torch
import transformers
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.engine import Engine
from nanoserve.core.request import Request, RequestStatus

BLOCK = 4
NEW = 8
SHARED = list(range(40, 56))  # 16 tokens: exactly 4 blocks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def expected(hf_model, prompt, num_new=NEW):
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=num_new,
        min_new_tokens=num_new,
    )
    return out[0, len(prompt) :].tolist()


def greedy(num_new=NEW):
    return SamplingParams(temperature=0.0, max_tokens=num_new, min_tokens=num_new)


def make_engine(checkpoint, **overrides):
    args = {
        "model": str(checkpoint),
        "dtype": "float32",
        "device": "cpu",
        "max_model_len": 128,
        "block_size": BLOCK,
    }
    args.update(overrides)
    return Engine(EngineConfig(**args))


def drain(engine, tokens=None):
    tokens = {} if tokens is None else tokens
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens


def test_fully_cached_prompt_of_whole_blocks_recomputes_only_its_last_token(checkpoint, hf_model):
    engine = make_engine(checkpoint)
    engine.add_request("first", SHARED, greedy())
    drain(engine)
    engine.add_request("again", SHARED, greedy())
    scheduled = engine.scheduler.schedule()
    # 3 of 4 blocks come from the cache by their hashes; the 4th, the block the first prompt
    # ended in, is a kept tail that gives all but its last token (which must run).
    assert scheduled.num_scheduled_tokens == {"again": 1}
    tokens = engine.scheduler.update(
        scheduled, *engine.runner.execute(scheduled, engine.eos_token_ids)
    )
    result = drain(engine, {"again": tokens[0].new_token_ids})
    assert result["again"] == expected(hf_model, SHARED)
    assert engine.stats().prefix_cache_hits == 15
    engine.scheduler.kv.pool.check_invariants()


def test_two_requests_sharing_a_prefix_admitted_in_the_same_step(checkpoint, hf_model):
    engine = make_engine(checkpoint)
    a, b = SHARED + [1, 2, 3], SHARED + [7, 8]
    engine.add_request("a", a, greedy())
    engine.add_request("b", b, greedy())
    scheduled = engine.scheduler.schedule()
    # b finds a's blocks, registered earlier in this same step, and runs only its own tail.
    assert scheduled.num_scheduled_tokens == {"a": 19, "b": 2}
    request_a, request_b = scheduled.requests
    assert request_a.block_ids[:4] == request_b.block_ids[:4]
    tokens = engine.scheduler.update(
        scheduled, *engine.runner.execute(scheduled, engine.eos_token_ids)
    )
    result = drain(engine, {d.request_id: list(d.new_token_ids) for d in tokens})
    assert result == {"a": expected(hf_model, a), "b": expected(hf_model, b)}


def test_preempted_after_cache_hit_resumes_with_the_same_tokens(checkpoint, hf_model):
    engine = make_engine(checkpoint, num_kv_blocks=12, max_model_len=48)
    engine.add_request("warm", SHARED, greedy(1))
    drain(engine)
    prompts = {"x": SHARED + [5], "y": SHARED + [6], "z": [9] * 17}
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, greedy(20))
    y = engine.scheduler.requests["y"]
    result, preempted_with_hit = {}, False
    while engine.has_unfinished_requests():
        for delta in engine.step():
            result.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        preempted_with_hit |= y.status == RequestStatus.PREEMPTED and y.num_cached_tokens > 0
    assert engine.stats().num_preemptions_total > 0
    assert preempted_with_hit or engine.scheduler.requests == {}
    assert result == {name: expected(hf_model, p, 20) for name, p in prompts.items()}
    assert engine.stats().kv_cache_usage == 0.0


def test_abort_while_another_request_shares_the_blocks(checkpoint, hf_model):
    engine = make_engine(checkpoint)
    keep, drop = SHARED + [1], SHARED + [2]
    engine.add_request("keep", keep, greedy())
    engine.add_request("drop", drop, greedy())
    result = {}
    for delta in engine.step():
        result.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    shared_blocks = engine.scheduler.requests["keep"].block_ids[:4]
    engine.abort(["drop"])
    pool = engine.scheduler.kv.pool
    assert [pool.blocks[b].ref_count for b in shared_blocks] == [1, 1, 1, 1]
    result.pop("drop", None)
    drain(engine, result)
    assert result["keep"] == expected(hf_model, keep)
    assert engine.scheduler.kv.num_free_blocks == engine.kv_cache.num_blocks
    pool.check_invariants()


def test_eviction_is_least_recently_freed_first(checkpoint):
    engine = make_engine(checkpoint, num_kv_blocks=10, max_model_len=32)
    kv = engine.scheduler.kv
    engine.add_request("old", [1] * 8, greedy(1))  # 2 full blocks: 0, 1
    drain(engine)
    engine.add_request("new", [2] * 8, greedy(1))  # 2 full blocks: 2, 3
    drain(engine)
    # Free blocks in eviction order: never used, then old's (in reverse), then new's.
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 8, 9, 1, 0, 3, 2]
    assert kv.find_cached_prefix(engine_request([1] * 9))[1] == 8
    engine.add_request("filler", [3] * 30, greedy(1))  # 8 blocks: 6 never used + old's 2
    filler = engine.scheduler.requests["filler"]
    engine.scheduler.schedule()
    assert filler.block_ids == [4, 5, 6, 7, 8, 9, 1, 0]
    assert kv.find_cached_prefix(engine_request([1] * 9))[1] == 0  # old prefix evicted
    assert kv.find_cached_prefix(engine_request([2] * 9))[1] == 8  # newer prefix kept


def engine_request(tokens):
    """A request that is only looked up, never run (fresh id: hashes are memoized per id)."""
    engine_request.count = getattr(engine_request, "count", 0) + 1
    return Request(f"probe-{engine_request.count}", tokens, greedy())


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [5, 2048])
def test_outputs_identical_with_caching_and_chunking_on_and_off(
    checkpoint, hf_model, caching, budget
):
    prompts = [SHARED + [i] * i for i in range(1, 6)] + [SHARED[:9], SHARED]
    engine = make_engine(checkpoint, enable_prefix_caching=caching, max_num_batched_tokens=budget)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy())
    result = drain(engine)
    assert [result[str(i)] for i in range(len(prompts))] == [expected(hf_model, p) for p in prompts]


def keystroke_after(hf_model, prompt, num_generated):
    """A next token for `prompt` that differs from what it generated first (the user typed on)."""
    return next(t for t in (5, 6) if t != expected(hf_model, prompt, num_generated)[0])


@pytest.mark.parametrize("ends_by", ["finishing", "abort"])
def test_the_next_keystroke_takes_over_the_partly_filled_block(checkpoint, hf_model, ends_by):
    """A request that extends a finished one's prompt shares the tokens in its partly filled last
    block too, not only its full blocks: it runs only what it adds."""
    engine = make_engine(checkpoint)
    kv = engine.scheduler.kv
    typed = SHARED + [1]  # 4 full blocks and one more token
    engine.add_request("typed", typed, greedy(2))
    if ends_by == "abort":
        engine.step()  # the prompt and one generated token
        engine.abort(["typed"])
    drain(engine)
    assert len(kv.pool.tails) == 1  # [1, first generated token], keys and values computed
    kept_block = next(iter(kv.pool.tails.values()))
    next_prompt = typed + [keystroke_after(hf_model, typed, 2)]
    engine.add_request("next", next_prompt, greedy())
    scheduled = engine.scheduler.schedule()
    assert scheduled.num_scheduled_tokens == {"next": 1}  # only the new keystroke runs
    request = engine.scheduler.requests["next"]
    assert request.block_ids[4] == kept_block and request.num_cached_tokens == 17
    assert kv.pool.tails == {}  # taken over: its slots after the shared token are rewritten
    tokens = engine.scheduler.update(
        scheduled, *engine.runner.execute(scheduled, engine.eos_token_ids)
    )
    result = drain(engine, {"next": tokens[0].new_token_ids})
    assert result["next"] == expected(hf_model, next_prompt)
    kv.pool.check_invariants()


def test_the_next_keystroke_shares_the_full_block_its_prompt_ended_in(checkpoint, hf_model):
    """The last request's generated tokens filled the block its prompt ended in; the next
    keystroke drops them, shares the prompt's tokens of that full block and runs only its own."""
    engine = make_engine(checkpoint)
    kv = engine.scheduler.kv
    typed = SHARED + [1, 2]  # 4 full blocks and 2 tokens; 4 generated fill the 5th block
    engine.add_request("typed", typed, greedy(4))
    drain(engine)
    ended_in = next(b.block_id for b in kv.pool.blocks if b.tail and b.tail[1][:2] == (1, 2))
    assert kv.pool.blocks[ended_in].block_hash is not None  # full and cached too
    next_prompt = typed + [keystroke_after(hf_model, typed, 4)]
    engine.add_request("next", next_prompt, greedy())
    scheduled = engine.scheduler.schedule()
    assert scheduled.num_scheduled_tokens == {"next": 1}
    request = engine.scheduler.requests["next"]
    assert request.block_ids[4] == ended_in and request.num_cached_tokens == 18
    assert kv.pool.blocks[ended_in].block_hash is None  # its old prefix is being rewritten
    tokens = engine.scheduler.update(
        scheduled, *engine.runner.execute(scheduled, engine.eos_token_ids)
    )
    result = drain(engine, {"next": tokens[0].new_token_ids})
    assert result["next"] == expected(hf_model, next_prompt)
    kv.pool.check_invariants()
    # The evicted prefix is not found again: the old request's whole text recomputes its 5th block.
    again = typed + expected(hf_model, typed, 4)
    cached, num_cached = kv.find_cached_prefix(Request("again", again, greedy()))
    assert num_cached < 20


def test_a_kept_tail_goes_to_one_request_and_is_evicted_like_any_free_block(checkpoint, hf_model):
    engine = make_engine(checkpoint, num_kv_blocks=12, max_model_len=48)
    kv = engine.scheduler.kv
    typed = SHARED + [1, 2]
    engine.add_request("typed", typed, greedy(1))
    drain(engine)
    assert list(kv.pool.tails.values()) == [4]
    # Two requests extend it in one step: the first takes the tail, the second recomputes.
    first, second = typed + [7], typed + [8]
    engine.add_request("first", first, greedy())
    engine.add_request("second", second, greedy())
    scheduled = engine.scheduler.schedule()
    assert scheduled.num_scheduled_tokens == {"first": 1, "second": 3}
    tokens = engine.scheduler.update(
        scheduled, *engine.runner.execute(scheduled, engine.eos_token_ids)
    )
    result = drain(engine, {d.request_id: list(d.new_token_ids) for d in tokens})
    assert result == {"first": expected(hf_model, first), "second": expected(hf_model, second)}
    kv.pool.check_invariants()
    # A kept tail is a free block: a request that needs blocks takes it (and it is forgotten).
    tails_before = set(kv.pool.tails.values())
    engine.add_request("filler", [3] * 40, greedy(3))
    engine.step()
    filler_blocks = set(engine.scheduler.requests["filler"].block_ids)
    assert tails_before & filler_blocks  # 11 of 12 blocks: some were tails
    assert not set(kv.pool.tails.values()) & filler_blocks
    kv.pool.check_invariants()
    drain(engine)
