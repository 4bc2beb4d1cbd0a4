"""What prompt logprobs cost: one prompt prefilled with and without scoring every position.

    python -m benchmarks.prompt_logprobs_cost [--models tiny,0.6b] [--prompt-len 512]
        [--rounds 5] [--threads 2]

In-process engine, dummy-weight bf16 Qwen3 checkpoints (nanoserve.bench.models), one greedy
request of --prompt-len random tokens and one output token, three arms interleaved round by
round: no prompt logprobs; `prompt_logprobs=0` (each prompt token's own logprob: lm-eval's
loglikelihood needs this much, plus rank 1 for greediness); `prompt_logprobs=20` (the most
the API allows). Scoring runs the LM head over every prompt row instead of the last one, then
log-softmax, gather and top-k over the vocabulary: for the 0.6B shape (151,936 tokens) that is
the work to watch. Prints the median wall time per arm and its ratio to the plain prefill.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from nanoserve.bench.models import make_dummy_checkpoint
from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.engine import Engine
from nanoserve.engine_setup import build_engine

MODELS = {"tiny": "tiny", "0.6b": "qwen3-0.6b"}
DEFAULT_MODEL_CACHE = Path.home() / ".cache" / "nanoserve" / "bench-models"
ARMS = {"plain": None, "prompt_logprobs=0": 0, "prompt_logprobs=20": 20}


def time_one(engine: Engine, prompt: list[int], prompt_logprobs: int | None, name: str) -> float:
    """Seconds from add_request to the finished request."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=prompt_logprobs)
    started = time.perf_counter()
    engine.add_request(name, prompt, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    elapsed = time.perf_counter() - started
    scored = deltas[0].prompt_logprobs
    assert (scored is None) == (prompt_logprobs is None)
    assert scored is None or len(scored) == len(prompt) - 1
    return elapsed


def measure(model_dir: Path, prompt_len: int, rounds: int) -> dict[str, list[float]]:
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=prompt_len + 16)
    engine = build_engine(config)
    rng = random.Random(0)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_index in range(rounds + 1):  # round 0 warms up and is not counted
        # A fresh prompt each round: the plain arm must not hit the prefix cache either.
        prompt = [rng.randrange(32, 127) for _ in range(prompt_len)]
        order = list(ARMS)[round_index % len(ARMS) :] + list(ARMS)[: round_index % len(ARMS)]
        for arm in order:
            elapsed = time_one(engine, prompt, ARMS[arm], f"{arm}-{round_index}")
            if round_index:
                times[arm].append(elapsed)
            prompt = prompt[1:] + prompt[:1]  # same tokens, no shared leading block
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,0.6b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_MODEL_CACHE)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.platform()}, {args.threads} threads, "
        f"load average {os.getloadavg()[0]:.2f}, prompt {args.prompt_len} tokens, "
        f"median of {args.rounds}"
    )
    print("| model | arm | median ms | × plain |")
    print("|---|---|---|---|")
    for name in args.models.split(","):
        preset = MODELS[name]
        model_dir = make_dummy_checkpoint(args.model_cache / preset, preset)
        times = measure(model_dir, args.prompt_len, args.rounds)
        plain = statistics.median(times["plain"])
        for arm, values in times.items():
            median = statistics.median(values)
            print(f"| {name} | {arm} | {median * 1000:.1f} | {median / plain:.2f} |")


if __name__ == "__main__":
    main()
