"""Decode step times in-process: the fused CPU decode step against layer-by-layer steps.

Two engines of one checkpoint side by side in one process, rounds alternating: the default
(decode steps through `FusedDecodeRunner`, linears as the kernels' build timed them) and
`--enforce-eager` with the bf16 GEMV for products of up to `--before-gemv-rows` tokens (the
default before the fused step and the timing existed: 4). Each batch size runs its requests
(100-token prompts, then `--steps` decode steps) and reports the median step.

    python -m benchmarks.decode_steps --model ~/.cache/nanoserve/bench-models/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import statistics
import time

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.llm import LLM
from nanoserve.platforms.cpu import linear as cpu_linear


def median_step_ms(llm: LLM, batch: int, tag: str, steps: int) -> float:
    """Median decode step of `batch` requests with 100-token prompts, in ms."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [1000 + 13 * i + j for j in range(100)], params)
    engine.step()  # the prompts
    engine.step()  # the first decode step
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--before-gemv-rows", type=int, default=4)
    args = parser.parse_args()
    tuned = cpu_linear.tuned_gemv_rows
    cpu_linear.tuned_gemv_rows = lambda: args.before_gemv_rows  # type: ignore[assignment]
    before = LLM(args.model, max_model_len=4096, enforce_eager=True)
    cpu_linear.tuned_gemv_rows = tuned  # type: ignore[assignment]
    now = LLM(args.model, max_model_len=4096)
    print(f"the kernels' build: GEMV for products of up to {tuned()} tokens", flush=True)
    print("| batch | before: layer by layer, GEMV ≤ 4 tokens, ms | now: fused, ms | before ÷ now |")
    print("|---|---|---|---|")
    for round_index in range(args.rounds):
        for batch in args.batches:
            tag = f"{round_index}-{batch}"
            a = median_step_ms(before, batch, "before-" + tag, args.steps)
            b = median_step_ms(now, batch, "now-" + tag, args.steps)
            print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
