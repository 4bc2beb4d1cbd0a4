"""Decode step times in-process: the fused CPU decode step against layer-by-layer steps.

Two engines of one checkpoint side by side in one process, rounds alternating: the default
(decode steps through `FusedDecodeRunner`, linears as the kernels' build timed them) and
`--enforce-eager` with the bf16 GEMV for products of up to `--before-gemv-rows` tokens (the
default before the fused step and the timing existed: 4). Each batch size runs its requests
(100-token prompts, then `--steps` decode steps) and reports the median step; beside it, the
median time of the default engine's matrix products alone (every linear of the model and the
LM head, as its linear methods run them on as many rows; timed after each step, so that both
see the same machine), and what a step costs outside its products, the difference.

    python -m benchmarks.decode_steps --model ~/.cache/nanoserve/bench-models/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.layers.linear import Linear
from nanoserve.llm import LLM
from nanoserve.platforms.cpu import linear as cpu_linear


def median_step_ms(
    llm: LLM, batch: int, tag: str, steps: int, between: Callable[[], None] | None = None
) -> float:
    """Median decode step of `batch` requests with 100-token prompts, in ms; `between()` runs
    after each timed step (outside its time)."""
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
        if between is not None:
            between()
    return statistics.median(times) * 1e3


def products_timer(llm: LLM, batch: int) -> tuple[Callable[[], None], list[float]]:
    """A pass over every linear of the model on `batch` rows, as its linear methods run them,
    and the list its times (s) go to."""
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features).bfloat16() for m in linears}
    times: list[float] = []

    def run() -> None:
        with torch.inference_mode():
            started = time.perf_counter()
            for layer in linears:
                layer.method.apply(layer, inputs[layer.in_features])
            times.append(time.perf_counter() - started)

    return run, times


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
    for llm in (before, now):  # the KV pools resident, as the server's worker makes them
        while llm.engine.idle_work():
            pass
    print(f"the kernels' build: GEMV for products of up to {tuned()} tokens", flush=True)
    print(
        "| batch | before: layer by layer, GEMV ≤ 4 tokens, ms | now: fused, ms | before ÷ now "
        "| now's products alone, ms | now − products, ms |"
    )
    print("|---|---|---|---|---|---|")
    for round_index in range(args.rounds):
        for batch in args.batches:
            tag = f"{round_index}-{batch}"
            a = median_step_ms(before, batch, "before-" + tag, args.steps)
            products, times = products_timer(now, batch)
            b = median_step_ms(now, batch, "now-" + tag, args.steps, between=products)
            c = statistics.median(times) * 1e3
            row = f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {c:.1f} | {b - c:.1f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
