"""What sampling costs a step, side by side: the sampler's passes over whole rows, and decode steps
greedy and at temperature 1.0, with the platform's `SamplerOps` against the Gumbel-max draw.

    python -m benchmarks.sampling [--model Qwen/Qwen3-0.6B] [--rounds 2] [--steps 40]

Part 1, the ops alone, per [B, V] shape (float32 rows, best of 3 runs): each row's argmax by
PyTorch's `max(dim=-1)` and by the platform's ops; a draw by the Gumbel-max trick (argmax(p /
E), E ~ Exp(1): one random number per token, what the sampler did before its inverse-transform
draw), by the portable inverse transform (`SamplerOps.draw`: a float64 cumsum) and by the
platform's ops.

Part 2, one engine of `--model` (dummy weights, the defaults a user gets), decode steps of 1 and 8
requests (37-token prompts, `--steps` tokens), greedy and at temperature 1.0, the sampler's ops
swapped between steps of the same engine: the platform's, and the same with the Gumbel-max draw
and PyTorch's argmax; arms alternating round by round. Reports the mean step in ms.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import time
from collections.abc import Callable

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.common.config import EngineConfig
from nanoserve.core.sampler import SamplerOps
from nanoserve.platforms.cpu.fast_paths import CpuPaths
from nanoserve.platforms.cpu.kernels import load_cpu_kernels

SHAPES = ((1, 4096), (4, 4096), (1, 151936), (8, 151936))


class GumbelMaxOps(SamplerOps):
    """The sampler as it drew before: argmax(p / E), E ~ Exp(1) per token; PyTorch's argmax."""

    def draw(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return self.argmax(probs / torch.empty_like(probs).exponential_())


def best_us(fn: Callable[[], object], calls: int) -> float:
    """The best of 3 runs of `calls` calls, in microseconds a call."""
    fn()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def ops_table(platform_ops: SamplerOps) -> list[str]:
    portable, gumbel = SamplerOps(), GumbelMaxOps()
    lines = [
        "| rows x vocab | argmax: torch max | argmax: platform | draw: Gumbel-max "
        "| draw: portable inverse transform | draw: platform |",
        "|---|---|---|---|---|---|",
    ]
    for rows, vocab in SHAPES:
        probs = torch.randn(rows, vocab).softmax(dim=-1)
        uniforms = torch.rand(rows, dtype=torch.float64)
        calls = max(3, 200_000 // (rows * vocab))
        passes: list[Callable[[], object]] = [
            functools.partial(portable.argmax, probs),
            functools.partial(platform_ops.argmax, probs),
            functools.partial(gumbel.draw, probs, uniforms),
            functools.partial(portable.draw, probs, uniforms),
            functools.partial(platform_ops.draw, probs, uniforms),
        ]
        cells = " | ".join(f"{best_us(p, calls):,.1f} us" for p in passes)
        lines.append(f"| {rows} x {vocab:,} | {cells} |")
    return lines


def mean_step_ms(llm: LLM, num_requests: int, temperature: float, steps: int) -> float:
    """Mean engine step over `num_requests` requests decoding `steps` tokens, prompts included."""
    engine = llm.engine
    params = SamplingParams(temperature=temperature, max_tokens=steps, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"s{time.monotonic_ns()}-{i}", list(range(3, 40 + i)), params)
    started, num_steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    return (time.perf_counter() - started) / num_steps * 1e3


def engine_table(args: argparse.Namespace) -> list[str]:
    llm = LLM(args.model, load_format="dummy", max_model_len=1024)
    sampler = llm.engine.runner.sampler
    arms = {"platform's ops": sampler.ops, "Gumbel-max draw, torch argmax": GumbelMaxOps()}
    for ops in arms.values():  # first steps settle threads and caches
        sampler.ops = ops
        mean_step_ms(llm, 2, 1.0, 4)
    times: dict[tuple[int, float, str], list[float]] = {}
    for round_index in range(args.rounds):
        order = list(arms) if round_index % 2 == 0 else list(arms)[::-1]
        for num_requests in (1, 8):
            for temperature in (0.0, 1.0):
                for name in order:
                    sampler.ops = arms[name]
                    step_ms = mean_step_ms(llm, num_requests, temperature, args.steps)
                    times.setdefault((num_requests, temperature, name), []).append(step_ms)
                    print(
                        f"round {round_index + 1} x{num_requests} T={temperature} {name}: "
                        f"{step_ms:.1f} ms",
                        flush=True,
                    )
    lines = [
        "| requests | temperature | " + " | ".join(arms) + " | ratio |",
        "|---|---|---|---|---|",
    ]
    for num_requests in (1, 8):
        for temperature in (0.0, 1.0):
            means = [sum(t) / len(t) for t in (times[(num_requests, temperature, n)] for n in arms)]
            cells = " | ".join(f"{m:.1f} ms" for m in means)
            lines.append(
                f"| {num_requests} | {temperature} | {cells} | {means[1] / means[0]:.2f}x |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B", help="a shape: dummy weights")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="tokens each request decodes")
    parser.add_argument("--skip-engine", action="store_true", help="the ops alone")
    args = parser.parse_args()
    print(
        f"# sampling, {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads"
    )
    if not args.skip_engine:
        print("\n".join(engine_table(args)))
    cpu_ops = CpuPaths(EngineConfig(model="unused"), load_cpu_kernels()).sampler_ops
    print("\n".join(ops_table(cpu_ops)))


if __name__ == "__main__":
    main()
