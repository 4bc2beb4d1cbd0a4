"""The fused CPU decode step (`platforms/cpu/fused_decode.py`) against the eager runner: the same
logprobs bit for bit, on every architecture, bf16 and int8; and the models it declines."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_checkpoints import ARCHITECTURES, MOE_ARCHITECTURES, make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.engine_setup import build_engine
from nanoserve.platforms.cpu import linear as cpu_linear
from nanoserve.platforms.cpu.attention import RUN_CHUNK_TOKENS
from nanoserve.platforms.cpu.fused_decode import GEMV_STEP_TOKENS, FusedDecodeRunner, layer_spans
from nanoserve.platforms.cpu.linear import packing_works


def runner_names(engine) -> list[str]:
    """The step runners' names, the thread governor's wrapper unwrapped."""
    names = []
    for runner in engine.runner.step_runners:
        names += [r.name for r in getattr(runner, "runners", [runner])]
    return names


def build(checkpoint, **config):
    settings = {"dtype": "bfloat16", "device": "cpu", "max_model_len": 128} | config
    return build_engine(EngineConfig(model=str(checkpoint), **settings))


def run(engine, prompts: list[list[int]], max_tokens: int = 12) -> dict[str, tuple]:
    """Greedy tokens and their top-5 logprobs of each prompt, all in one batch; the i-th prompt
    runs for max_tokens + i tokens (so the batch shrinks a request at a time)."""
    results: dict[str, tuple[list, list]] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens + i, ignore_eos=True, logprobs=5
        )
        engine.add_request(str(i), prompt, params)
        results[str(i)] = ([], [])
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id][0].extend(delta.new_token_ids)
            results[delta.request_id][1].extend(delta.logprobs or [])
    return {key: (tokens, repr(logprobs)) for key, (tokens, logprobs) in results.items()}


@pytest.fixture
def counted_fused_steps(monkeypatch) -> list[int]:
    """How many tokens each fused step ran (so that a test sees the fused path was taken)."""
    steps: list[int] = []
    real_run = FusedDecodeRunner.run

    def counting_run(self, layout):
        steps.append(len(layout.input_ids))
        return real_run(self, layout)

    monkeypatch.setattr(FusedDecodeRunner, "run", counting_run)
    return steps


@pytest.mark.parametrize(
    ("quantization", "gemv_rows"),
    [(None, 0), (None, 3), ("int8", 0)],  # bf16 packed (GEMV for none, or up to 3 tokens), int8
)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fused_decode_gives_the_eager_runners_logprobs(
    tmp_path, monkeypatch, architecture, quantization, gemv_rows, counted_fused_steps
):
    # Whatever this machine's build timed, both ways of a packed linear's decode product.
    monkeypatch.setattr(cpu_linear, "tuned_gemv_rows", lambda: gemv_rows)
    checkpoint = make_tiny_checkpoint(tmp_path, architecture)
    fused = build(checkpoint, quantization=quantization)
    eager = build(checkpoint, quantization=quantization, enforce_eager=True)
    assert "cpu-fused-decode" in runner_names(fused)
    assert "cpu-fused-decode" not in runner_names(eager)
    rng = random.Random(0)
    lengths = (3, 17, 40, 9, 30, 5, 12, 2, 21, 8)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in lengths]
    # One request, four, ten (with GEMVs, eager decode steps until two finish), then prompts
    # that extend cached ones by a token (decode-shaped).
    batches = [prompts[:1], prompts[:4], prompts, [p + [7] for p in prompts[:3]]]
    for batch in batches:
        assert run(fused, batch) == run(eager, batch)
    most = fused_runner(fused).max_tokens
    assert (most is None) == (quantization is None and packing_works())  # oneDNN: any size
    decode_sizes = set(range(1, (most or len(prompts)) + 1))
    assert decode_sizes <= set(counted_fused_steps)  # (and prompts whose tokens see few keys)
    assert most is None or max(counted_fused_steps) <= most


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_layers_with_experts_decode_fused_with_the_eager_runners_logprobs_and_expert_load(
    tmp_path, architecture, quantization, counted_fused_steps
):
    checkpoint = make_tiny_checkpoint(tmp_path, architecture)
    fused = build(checkpoint, quantization=quantization)
    eager = build(checkpoint, quantization=quantization, enforce_eager=True)
    assert "cpu-fused-decode" in runner_names(fused)
    assert fused_runner(fused).max_tokens == GEMV_STEP_TOKENS  # the grouped GEMVs' steps
    rng = random.Random(1)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (3, 17, 40, 9, 30, 5, 12, 2, 21)]
    # One request, then nine: eager decode steps until the batch is down to eight.
    for batch in (prompts[:1], prompts):
        assert run(fused, batch) == run(eager, batch)
    assert set(counted_fused_steps) == set(range(1, GEMV_STEP_TOKENS + 1))
    # Every step's choices were counted, fused or not: the same load as the eager engine's.
    load = fused.model.expert_load()
    assert torch.equal(load, eager.model.expert_load()) and load.sum() > 0


def fused_runner(engine) -> FusedDecodeRunner:
    [runner] = [
        r
        for runner in engine.runner.step_runners
        for r in getattr(runner, "runners", [runner])
        if isinstance(r, FusedDecodeRunner)
    ]
    return runner


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_prompt_chunks_and_steps_past_a_gemvs_size_go_to_the_eager_runner(
    tmp_path, quantization, counted_fused_steps
):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")
    engine = build(checkpoint, quantization=quantization, max_model_len=256)
    prompts = [[i + 1] * (RUN_CHUNK_TOKENS + 1 + i) for i in range(GEMV_STEP_TOKENS + 1)]
    # Nine prefills (eager: each more tokens than the kernel attends as a run, whose tokens see
    # more keys than it attends one by one), a decode step of all nine (eager where the
    # linears' decode products are GEMVs: one token more than they take), then steps of 8, 7,
    # ... 1 as the requests finish one by one.
    run(engine, prompts, max_tokens=2)
    first = len(prompts) if fused_runner(engine).max_tokens is None else GEMV_STEP_TOKENS
    assert counted_fused_steps == list(range(first, 0, -1))


@pytest.mark.parametrize(
    ("architecture", "config"),
    [
        ("qwen3", {"dtype": "float32"}),  # the GEMVs take bf16
        ("qwen3", {"kv_cache_dtype": "fp8"}),  # the attention reads an FP8 cache
        ("qwen3_moe", {"kv_cache_dtype": "fp8"}),  # with experts too
    ],
)
def test_models_with_a_piece_it_does_not_know_decode_layer_by_layer(
    tmp_path, architecture, config, caplog
):
    with caplog.at_level("INFO", logger="nanoserve.fused_decode"):
        engine = build(make_tiny_checkpoint(tmp_path, architecture), **config)
    assert "cpu-fused-decode" not in runner_names(engine)
    assert "decode steps run layer by layer" in caplog.text
    tokens, _ = run(engine, [[1, 2, 3]], max_tokens=3)["0"]
    assert len(tokens) == 3


def test_layer_spans_cover_the_layers_in_order():
    assert layer_spans(28, 4) == [(0, 7), (7, 14), (14, 21), (21, 28)]
    assert layer_spans(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert layer_spans(2, 4) == [(0, 1), (1, 2)]
    assert layer_spans(1, 4) == [(0, 1)]


def counted_span_calls(runner: FusedDecodeRunner) -> list[tuple[int, int]]:
    """The (begin, end) of each call the runner makes to its `DecodeLayers` from now on."""
    calls: list[tuple[int, int]] = []
    layers = runner.layers

    class Counted:
        num_layers = layers.num_layers

        def __call__(self, *args):
            calls.append(args[-3:-1])  # (begin, end)
            return layers(*args)

    runner.layers = Counted()
    return calls


def greedy(engine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() if d.request_id == request_id for t in d.new_token_ids]
    return tokens


def test_a_step_whose_requests_were_all_aborted_stops_after_a_span_and_leaves_nothing(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")
    engine, fresh = build(checkpoint), build(checkpoint)
    prompt = [5, 9, 2, 7] * 5
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("old", prompt, params)
    decoded = [t for _ in range(4) for d in engine.step() for t in d.new_token_ids]
    old = engine.scheduler.running[0]
    computed = old.num_computed_tokens
    calls = counted_span_calls(fused_runner(engine))
    # The next decode step asks between spans; only "old" is in it, and it was aborted.
    asked: list[list[str]] = []
    deltas = engine.step(lambda ids: asked.append(ids) or ids == ["old"])
    assert deltas == [] and asked == [["old"]] and calls == [(0, 1)]
    assert old.num_computed_tokens == computed and old.output_token_ids == decoded
    engine.abort(["old"])  # what the loop does next, with the abort it read early
    engine.scheduler.kv.pool.check_invariants()
    # The keystroke after it shares the old prompt and tokens (its cached tail included):
    # the keys the abandoned step wrote past them change none of its tokens.
    keystroke = prompt + decoded + [3]
    hits = engine.scheduler.kv.num_prefix_hits
    assert greedy(engine, "new", keystroke, 6) == greedy(fresh, "new", keystroke, 6)
    assert engine.scheduler.kv.num_prefix_hits - hits == computed


def test_a_step_with_a_request_not_aborted_runs_every_span(tmp_path):
    engine = build(make_tiny_checkpoint(tmp_path, "qwen3"))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    engine.step()  # the prompts
    calls = counted_span_calls(fused_runner(engine))
    deltas = engine.step(lambda ids: set(ids) <= {"a"})  # "b" was not aborted
    assert sorted(d.request_id for d in deltas) == ["a", "b"]
    assert calls == [(0, 1), (1, 2)]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_short_prompt_chunks_go_fused_and_give_the_eager_runners_logprobs(
    tmp_path, quantization, counted_fused_steps
):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")
    fused = build(checkpoint, quantization=quantization)
    eager = build(checkpoint, quantization=quantization, enforce_eager=True)
    rng = random.Random(1)
    # Three prompts of at most SHORT_CHUNK_TOKENS tokens in one step (every token attends
    # through the paged-decode kernel; 8 tokens, what an int8 step takes), then each extended
    # by two tokens over its cached blocks.
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (3, 2, 3)]
    extended = [p + [rng.randrange(0, 256) for _ in range(2)] for p in prompts]
    for batch in (prompts, extended):
        assert run(fused, batch, max_tokens=4) == run(eager, batch, max_tokens=4)
    assert 8 in counted_fused_steps  # the three prompts' step: 3 + 2 + 3 tokens
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1)
    fused.add_request("scored", [1, 2, 3], scored)
    counted_fused_steps.clear()
    while fused.has_unfinished_requests():
        fused.step()
    assert counted_fused_steps == [1]  # the prompt, whose logprobs it scores, ran eager


def test_longer_prompts_go_fused_while_their_tokens_see_few_keys_or_make_one_run(
    tmp_path, counted_fused_steps, kernels
):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")  # head dims of 32: runs where built
    fused = build(checkpoint, max_model_len=256)
    eager = build(checkpoint, max_model_len=256, enforce_eager=True)
    rng = random.Random(2)
    # 40 tokens: 820 (token, key) pairs, attended token by token; 100 tokens: 5,050, too many
    # one by one but one run of the kernel's chunks; 140: more than a run takes.
    for length in (40, 100, 140):
        prompt = [rng.randrange(0, 256) for _ in range(length)]
        assert run(fused, [prompt], max_tokens=3) == run(eager, [prompt], max_tokens=3)
    runner = fused_runner(fused)
    most = runner.max_tokens  # None where oneDNN takes the products of any size
    assert runner.chunk_runs == kernels.prompt_attention_is_available()  # bf16, blocks of 16
    assert (40 in counted_fused_steps) == (most is None)
    assert (100 in counted_fused_steps) == (most is None and runner.chunk_runs)
    assert 140 not in counted_fused_steps
