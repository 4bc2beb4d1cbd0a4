"""Speculative decoding, side by side in one run: no speculation, n-gram and suffix drafts.

    python -m benchmarks.speculative_decoding [--rounds 3] [--concurrency 1 8 32]
        [--cost-shape Qwen/Qwen3-0.6B] [--model DIR] [--workloads no-repeat]

Part 1, on the demo model (real weights, so acceptance means something), in-process engines
(`LLM`, the defaults a user gets plus `--speculative-config`), arms alternating batch by batch:

    edit          a code-editing request: the prompt holds a Python module of this repository
                  (its first ~300 tokens), then asks for the same module with a name changed
                  and starts it; greedy, as long as the module. Every batch, the warm-up's
                  included, takes modules no earlier batch used (until the repository's
                  modules run out: at 32 concurrent they come round again), so a suffix
                  trie of earlier outputs never holds the very output it is asked for
    no-repeat     a short prompt sampled at temperature 1.0 for 500 tokens: output that repeats
                  nothing
    autocomplete  ~10-token greedy completions of a module's first lines: time to first token

At each concurrency (requests submitted together; each measurement is --repeats such batches of
different prompts) it reports output tok/s end to end (prompts included), decode tok/s a stream
(each stream's tokens after its first over the time from its first to its last: speculation's
own gain, since it drafts nothing for a prompt), each with its ratio to no speculation, and
per proposer the draft acceptance rate and mean acceptance length. `--model` runs part 1 on
another checkpoint (a dummy-weight shape's acceptance means nothing, but its no-repeat workload
shows what speculation costs where a step is as long as a real model's).

Part 2, the cost side of a draft model, where only random-weight shapes exist offline: the
time of one engine step of `--cost-shape` (dummy weights, one request with a 512-token
context) verifying k + 1 tokens against a one-token step, for k = 1..4. With a draft that
costs c one-token target steps per drafted token, k drafts pay off when the expected tokens
per step, (1 - a^(k+1)) / (1 - a) at acceptance a, exceed (verify(k) + k * c) / step(1).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import platform
import random
import statistics
import time
from pathlib import Path
from typing import NamedTuple

from nanoserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
EDIT_FOLDERS = ("nanoserve", "benchmarks", "scripts", "tests")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
ARMS = {"none": None, "ngram": NGRAM | {"prompt_lookup_max": 5}, "suffix": {"method": "suffix"}}


@functools.cache
def edit_files() -> list[str]:
    """The repository's modules an edit can rename `self` in (over 1,500 characters), in an
    order fixed by a seed that mixes the folders."""
    paths = [
        str(path.relative_to(ROOT))
        for folder in EDIT_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.stat().st_size > 1500 and "self." in path.read_text()
    ]
    random.Random(0).shuffle(paths)
    return paths  # (read once per run: every batch takes its modules from it)


def edit_prompts(llm: LLM, paths: list[str]) -> list[tuple[str, int]]:
    """(prompt, max_tokens) per module: the module, then the same module with a name changed,
    begun."""
    tokenizer = llm.tokenizer
    prompts = []
    for path in paths:
        ids = tokenizer.encode((ROOT / path).read_text())[:300]
        module = tokenizer.decode(ids)
        first_line = module.split("\n", 1)[0]
        prompt = f"# {path}\n{module}\n\n# {path}, with `self` renamed to `this`:\n{first_line}\n"
        prompts.append((prompt, len(ids)))
    return prompts


class BatchRun(NamedTuple):
    """One batch's output tokens and seconds, end to end and while decoding (each stream from
    its first token to its last: the rate `vllm bench serve` reports as 1 / TPOT)."""

    num_tokens: int
    seconds: float
    num_decode_tokens: int  # every stream's tokens after its first
    decode_seconds: float  # summed over the streams


def run_batch(llm: LLM, prompts: list[tuple[str, int]], temperature: float) -> BatchRun:
    """Generate every prompt together, through the engine's steps (to see each token come)."""
    engine = llm.engine
    prompt_ids = [llm.tokenizer.encode(prompt) for prompt, _ in prompts]
    first_s: dict[str, float] = {}
    last_s: dict[str, float] = {}
    counts: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    for index, (ids, (_, max_tokens)) in enumerate(zip(prompt_ids, prompts, strict=True)):
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=index
        )
        engine.add_request(f"batch-{time.monotonic_ns()}-{index}", ids, params)
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            if delta.new_token_ids:
                first_s.setdefault(delta.request_id, now)
                last_s[delta.request_id] = now
                counts[delta.request_id] += len(delta.new_token_ids)
    elapsed = time.perf_counter() - started
    num_tokens = sum(counts.values())
    decode_s = sum(last_s[r] - first_s[r] for r in counts)
    return BatchRun(num_tokens, elapsed, num_tokens - len(counts), decode_s)


def ttft_ms(llm: LLM, prompts: list[str]) -> float:
    """Mean time to the first token of 10-token greedy completions, one at a time."""
    engine, times = llm.engine, []
    for index, prompt in enumerate(prompts):
        ids = llm.tokenizer.encode(prompt)
        started = time.perf_counter()
        engine.add_request(
            f"ac-{time.monotonic_ns()}-{index}", ids, SamplingParams(max_tokens=10, temperature=0)
        )
        first = None
        while engine.has_unfinished_requests():
            if any(d.new_token_ids for d in engine.step()) and first is None:
                first = time.perf_counter() - started
        times.append(first or 0.0)
    return 1000 * statistics.mean(times)


def acceptance(llm: LLM, before) -> tuple[float, float]:
    """(draft acceptance rate, mean acceptance length) since the stats `before`."""
    stats = llm.engine.stats().spec_decode
    if stats is None or before is None:
        return float("nan"), float("nan")
    drafts = stats.num_drafts - before.num_drafts
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    if not drafts:
        return 0.0, 1.0
    return accepted / drafted, 1 + accepted / drafts


def part_one(args: argparse.Namespace) -> list[str]:
    """Every workload and concurrency, the arms alternating batch by batch (this machine's
    rate moves within seconds: each batch runs on every arm before the next batch)."""
    llms = {name: LLM(args.model, speculative_config=spec) for name, spec in ARMS.items()}
    warm_up = edit_prompts(llms["none"], edit_files()[-2:])
    for llm in llms.values():  # first steps settle threads and caches: not measured
        run_batch(llm, warm_up, 0.0)
    results: dict[tuple[str, int, str], list[Measured]] = {}
    for round_index in range(args.rounds):
        for workload in args.workloads:
            for concurrency in args.concurrency:
                first = round_index * args.repeats
                runs: dict[str, list[BatchRun]] = {name: [] for name in ARMS}
                before = {name: llm.engine.stats().spec_decode for name, llm in llms.items()}
                for batch in range(first, first + args.repeats):
                    prompts, temperature = workload_prompts(
                        llms["none"], workload, concurrency, batch
                    )
                    for name in _rotated(list(ARMS), batch):
                        runs[name].append(run_batch(llms[name], prompts, temperature))
                for name, llm in llms.items():
                    run = BatchRun(*(sum(column) for column in zip(*runs[name], strict=True)))
                    measured = Measured(run, *acceptance(llm, before[name]))
                    results.setdefault((workload, concurrency, name), []).append(measured)
                    print(
                        f"round {round_index + 1}/{args.rounds} {workload} x{concurrency} "
                        f"{name}: {run.num_tokens / run.seconds:.1f} tok/s, decode "
                        f"{run.num_decode_tokens / run.decode_seconds:.1f} tok/s a stream, "
                        f"acceptance {measured.rate:.2f}, mean length {measured.length:.2f}",
                        flush=True,
                    )
    return throughput_table(results) + [""] + ttft_table(llms, args.model)


def workload_prompts(llm: LLM, workload: str, concurrency: int, batch: int):
    """The prompts (with max_tokens) and temperature of a workload's `batch`-th batch (each
    batch its own modules or words; the warm-up took the last two modules)."""
    if workload == "edit":
        paths = edit_files()[:-2]
        first = batch * concurrency
        return edit_prompts(
            llm, [paths[i % len(paths)] for i in range(first, first + concurrency)]
        ), 0.0
    rng = random.Random(1000 * batch + concurrency)
    words = ["data", "value", "x", "(", ")", "=", "+", "\n", "for", "in"]
    return [(" ".join(rng.choice(words) for _ in range(30)), 500) for _ in range(concurrency)], 1.0


class Measured(NamedTuple):
    """An arm's batches in one round, and its drafts' acceptance over them."""

    run: BatchRun
    rate: float  # draft acceptance rate
    length: float  # mean acceptance length


def throughput_table(results: dict[tuple[str, int, str], list[Measured]]) -> list[str]:
    lines = [
        "| workload | concurrent | arm | output tok/s | vs none | decode tok/s a stream "
        "| vs none | acceptance rate | mean acceptance length |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, concurrency, name), measured in sorted(results.items()):
        runs, base_runs = (
            [m.run for m in measured],
            [m.run for m in results[(workload, concurrency, "none")]],
        )
        output, base_output = _rate(runs, decode=False), _rate(base_runs, decode=False)
        decode, base_decode = _rate(runs, decode=True), _rate(base_runs, decode=True)
        cells = [workload, str(concurrency), name, f"{output:.1f}", f"{output / base_output:.2f}x"]
        cells += [f"{decode:.1f}", f"{decode / base_decode:.2f}x"]
        if name == "none":
            cells += ["-", "-"]
        else:
            cells += [f"{statistics.mean(m.rate for m in measured):.2f}"]
            cells += [f"{statistics.mean(m.length for m in measured):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _rate(runs: list[BatchRun], decode: bool) -> float:
    """Output tokens a second over `runs`, end to end or while decoding (a stream's)."""
    if decode:
        return sum(r.num_decode_tokens for r in runs) / sum(r.decode_seconds for r in runs)
    return sum(r.num_tokens for r in runs) / sum(r.seconds for r in runs)


def ttft_table(llms: dict[str, LLM], model: str) -> list[str]:
    autocomplete = [prompt[:200] for prompt, _ in edit_prompts(llms["none"], edit_files()[:6])]
    ttfts = {name: ttft_ms(llm, autocomplete) for name, llm in llms.items()}
    return [
        "| autocomplete TTFT, mean of 6 (ms) | " + " | ".join(ARMS) + " |",
        "|---|" + "---|" * len(ARMS),
        f"| {Path(model).name} | " + " | ".join(f"{ttfts[n]:.1f}" for n in ARMS) + " |",
    ]


def _rotated(names: list[str], round_index: int) -> list[str]:
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def part_two(args: argparse.Namespace) -> list[str]:
    """Step time of `--cost-shape` verifying k + 1 tokens against a one-token step."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(args.cost_shape, load_format="dummy", speculative_config=spec, max_model_len=2048)
    engine, rng = llm.engine, random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    engine.add_request("cost", [rng.randrange(32, 127) for _ in range(512)], params)
    engine.step()  # the prefill
    request = engine.scheduler.requests["cost"]
    times: dict[int, list[float]] = {k: [] for k in range(5)}
    for _ in range(args.cost_steps):
        for k in times:
            request.spec_token_ids = [rng.randrange(32, 127) for _ in range(k)]
            started = time.perf_counter()
            engine.step()
            times[k].append(time.perf_counter() - started)
    base = statistics.median(times[0])
    lines = [
        f"| {args.cost_shape} (dummy), context ~512 | step ms, median of {args.cost_steps} "
        "| vs a one-token step |",
        "|---|---|---|",
    ]
    for k, values in times.items():
        median = statistics.median(values)
        label = f"verify {k} drafts ({k + 1} tokens)" if k else "one token (no drafts)"
        lines.append(f"| {label} | {1000 * median:.1f} | {median / base:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3, help="batches per measurement")
    parser.add_argument("--cost-shape", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--cost-steps", type=int, default=8)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--model", default="nanoserve-demo", help="part 1's checkpoint")
    parser.add_argument(
        "--workloads", nargs="+", choices=["edit", "no-repeat"], default=["edit", "no-repeat"]
    )
    args = parser.parse_args()
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.processor() or platform.machine()}")
    lines = part_one(args)
    if not args.skip_cost:
        lines += [""] + part_two(args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
