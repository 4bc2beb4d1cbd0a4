"""Speculative decoding through the real engine: greedy output identical to plain decoding for
every proposer, on the 4 architectures, through every scheduling path; the KV cache's
invariants hold every step and every block comes back after rejections, aborts and
preemptions; a draft model equal to the target accepts every draft."""

from __future__ import annotations

import random

import pytest
from pinned_step_costs import pin_free_verify_steps
from tiny_checkpoints import ARCHITECTURES, make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.core.engine import Engine
from nanoserve.core.request import Request
from nanoserve.core.speculation import Speculator
from nanoserve.engine_setup import build_engine

NUM_NEW_TOKENS = 24
PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model": {"num_speculative_tokens": 3},  # the model: the target's own checkpoint
}
PATHS = {
    "batched": {},
    "chunked": {"max_num_batched_tokens": 16},
    "preempted": {"num_kv_blocks": 12, "max_num_seqs": 8},
    "no_prefix_cache": {"enable_prefix_caching": False},
}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def prompts() -> list[list[int]]:
    """Prompts that repeat themselves (drafts get proposed, accepted and rejected), and not."""
    rng = random.Random(0)
    repeated = [rng.randrange(0, 256) for _ in range(7)]
    return [
        repeated * 4,
        [rng.randrange(0, 256) for _ in range(19)],
        repeated[:3] * 6 + [5],
        [9, 9, 9, 9, 9, 9, 9, 9, 9, 9],
        [rng.randrange(0, 256) for _ in range(40)],
    ]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)


def make_engine(checkpoint, proposer: str | None, **overrides) -> Engine:
    args = {"model": str(checkpoint), "dtype": "float32", "device": "cpu", "max_model_len": 128}
    if proposer is not None:
        spec = dict(PROPOSERS[proposer])
        if proposer == "draft_model":
            spec["model"] = str(checkpoint)
        args["speculative_config"] = SpeculativeConfig.from_dict(spec)
    engine = build_engine(EngineConfig(**(args | overrides)))
    pin_free_verify_steps(engine)  # these tests check verification: every step drafts
    return engine


def run_checked(engine: Engine, prompt_list, params) -> list[list[int]]:
    """Run every prompt to the end, checking the block pool's invariants after every step."""
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompt_list))}
    for i, prompt in enumerate(prompt_list):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
        engine.scheduler.kv.pool.check_invariants()
    assert engine.scheduler.kv.num_free_blocks == engine.kv_cache.num_blocks  # none leaked
    return [tokens[str(i)] for i in range(len(prompt_list))]


@pytest.fixture(scope="module")
def plain_tokens(checkpoint):
    return run_checked(make_engine(checkpoint, None), prompts(), greedy())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_output_is_unchanged(checkpoint, plain_tokens, proposer, path):
    engine = make_engine(checkpoint, proposer, **PATHS[path])
    assert run_checked(engine, prompts(), greedy()) == plain_tokens
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens > 0  # drafts were really verified
    if proposer == "draft_model":  # the target drafting for itself: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if path == "preempted":
        assert engine.stats().num_preemptions_total > 0
    engine.shutdown()


class RecordingSpeculator(Speculator):
    """Drafts nothing; records the output lengths of the requests it is asked to draft for."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def propose(self, requests: list[Request]) -> None:
        self.seen.append([r.num_output_tokens for r in requests])


def test_drafts_are_proposed_at_the_start_of_a_step_not_before_its_tokens_go_out(checkpoint):
    engine = make_engine(checkpoint, None)
    recorder = engine.speculator = RecordingSpeculator()
    engine.add_request(
        "a", prompts()[1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
    # Each step's start sees what the steps before it gave; none runs after the last one.
    assert recorder.seen == [[], [1], [2]]
    engine.shutdown()


def test_draft_model_equal_to_target_runs_k_plus_one_tokens_a_step(checkpoint, plain_tokens):
    engine = make_engine(checkpoint, "draft_model")
    engine.add_request("only", prompts()[1], greedy())
    engine.step()  # the prefill: one token
    step_sizes = []
    while engine.has_unfinished_requests():
        step_sizes.append(sum(len(d.new_token_ids) for d in engine.step()))
    # k + 1 = 4 tokens a step until max_tokens cuts the drafts short.
    assert step_sizes[: (NUM_NEW_TOKENS - 1) // 4] == [4] * ((NUM_NEW_TOKENS - 1) // 4)
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.num_accepted_per_position[0] == stats.num_drafts
    engine.shutdown()


def test_aborts_in_the_middle_of_speculation_return_every_block(checkpoint):
    engine = make_engine(checkpoint, "ngram", num_kv_blocks=16)
    for i, prompt in enumerate(prompts()):
        engine.add_request(str(i), prompt, greedy())
    for step in range(6):
        engine.step()
        engine.scheduler.kv.pool.check_invariants()
        if step == 3:
            engine.abort(["0", "2"])
    engine.abort(list(engine.scheduler.requests))
    engine.scheduler.kv.pool.check_invariants()
    assert engine.scheduler.kv.num_free_blocks == engine.kv_cache.num_blocks


def test_rejected_drafts_never_enter_the_prefix_cache(checkpoint):
    """After a run whose drafts were rejected, every cached block holds the tokens its hash
    names, all of them known tokens of the request (no draft ever named a block)."""
    engine = make_engine(checkpoint, "ngram", block_size=4)
    params = greedy()
    engine.add_request("a", prompts()[2], params)
    known: list[int] = list(prompts()[2])
    while engine.has_unfinished_requests():
        for delta in engine.step():
            known += delta.new_token_ids
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens < stats.num_draft_tokens
    # The same tokens again hit every token but the last (the partly filled last block's too).
    engine.add_request("b", known, SamplingParams(temperature=0.0, max_tokens=1))
    scheduled = engine.scheduler.schedule()
    assert scheduled.requests[0].num_computed_tokens == len(known) - 1


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_seeded_sampled_requests_repeat_themselves_with_speculation(checkpoint, proposer):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NUM_NEW_TOKENS, seed=11)
    runs = []
    for _ in range(2):
        engine = make_engine(checkpoint, proposer)
        runs.append(run_checked(engine, prompts()[:2], params))
        stats = engine.stats().spec_decode
        assert stats is not None and stats.num_draft_tokens > 0
    assert runs[0] == runs[1]


def test_constrained_requests_draft_within_their_grammar(checkpoint):
    """Drafts of a structured-output request stop where its grammar refuses; each draft row is
    masked at its own state; the output is the plain engine's, and follows the grammar."""
    from nanoserve.common.sampling_params import StructuredOutputsParams

    constraint = StructuredOutputsParams(regex="(ab|cd){10}")
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, structured_outputs=constraint
    )
    outputs = []
    for proposer in (None, "ngram"):
        engine = make_engine(checkpoint, proposer)
        outputs.append(run_checked(engine, prompts()[:3], params))
        engine.shutdown()
    assert outputs[0] == outputs[1]
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
    for tokens in outputs[1]:
        text = bytes(t for t in tokens if t < 256).decode()
        assert (
            text
            and set(text) <= set("abcd")
            and all(text[i : i + 2] in ("ab", "cd") for i in range(0, len(text) - 1, 2))
        )


def test_an_fp8_kv_cache_verifies_drafts_as_it_decodes(checkpoint):
    """Speculation over an FP8 KV cache gives the FP8 cache's own greedy tokens."""
    outputs = []
    for proposer in (None, "ngram"):
        engine = make_engine(checkpoint, proposer, kv_cache_dtype="fp8")
        outputs.append(run_checked(engine, prompts(), greedy()))
    assert outputs[0] == outputs[1]
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
