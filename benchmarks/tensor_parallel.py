"""Tensor parallel 2 (one thread per rank) against one rank with two threads, on this CPU.

    python -m benchmarks.tensor_parallel --preset qwen3-0.6b

First it measures what the ranks' communication costs: gloo all-reduces of one step's hidden
states between two processes of one thread each, at decode (1 and 8 tokens) and prefill sizes,
and multiplies by the all-reduces a step makes (two per layer and one for the embedding) plus the
gather of the logits. Then it runs `nanoserve bench`'s scoreboard with the two servers as arms,
interleaved (`--rounds`), and prints both.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve.bench.models import PRESETS
from nanoserve.bench.serve_bench import main as bench_main

TOKEN_COUNTS = (1, 8, 256)
REPEATS = 50


def _measure(rank: int, rendezvous: str, hidden: int, vocab: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    timings = {}
    for num_tokens in TOKEN_COUNTS:
        x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16)
        logits = torch.randn(min(num_tokens, 8), vocab // 2)
        parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
        for name, op in (
            ("all_reduce", lambda x=x: dist.all_reduce(x)),
            ("gather_logits", lambda y=logits, p=parts: dist.gather(y, p)),
        ):
            op()
            dist.barrier()
            started = time.perf_counter()
            for _ in range(REPEATS):
                op()
            timings[f"{name}_{num_tokens}"] = (time.perf_counter() - started) / REPEATS
    if rank == 0:
        Path(out).write_text(json.dumps(timings))
    dist.destroy_process_group()


def communication_cost(preset: str) -> dict:
    shape = PRESETS[preset]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/timings.json"
        args = (f"file://{tmp}/rendezvous", shape["hidden_size"], shape["vocab_size"], out)
        mp.spawn(_measure, args=args, nprocs=2)
        timings = json.loads(Path(out).read_text())
    per_step = 2 * shape["num_hidden_layers"] + 1
    return {
        n: {
            "all_reduce_ms": 1000 * timings[f"all_reduce_{n}"],
            "all_reduces_per_step": per_step,
            "step_ms": 1000
            * (per_step * timings[f"all_reduce_{n}"] + timings[f"gather_logits_{n}"]),
        }
        for n in TOKEN_COUNTS
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"communication per step, 2 ranks x 1 thread, gloo, {args.preset} shape:")
    print(
        "| tokens in the step | one all-reduce ms | all-reduces | per step ms (+ logits gather) |"
    )
    print("|---|---|---|---|")
    for num_tokens, cost in communication_cost(args.preset).items():
        print(
            f"| {num_tokens} | {cost['all_reduce_ms']:.3f} | {cost['all_reduces_per_step']} | "
            f"{cost['step_ms']:.2f} |"
        )
    serve = (
        f"{sys.executable} -m nanoserve.cli.main serve --model {{model}} --port {{port}} "
        "--max-model-len 2048"
    )
    # Each arm's command sets its own threads (the harness's OMP_NUM_THREADS is overridden).
    return bench_main(
        [
            "--workload",
            "scoreboard",
            "--preset",
            args.preset,
            "--rounds",
            str(args.rounds),
            "--arm",
            f"cmd=tp1-2threads=OMP_NUM_THREADS=2 {serve}",
            "--arm",
            f"cmd=tp2-1thread-each=OMP_NUM_THREADS=1 {serve} -tp 2",
            "--baseline",
            "tp1-2threads",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
