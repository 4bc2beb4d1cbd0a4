"""GPU decode throughput of the engine on a dummy-weight preset: one request and a batch.

    python -m benchmarks.gpu_decode --model Qwen/Qwen3-1.7B --batch-sizes 1,16,64

Prints a markdown table (and writes it to --output when given): decode tokens/s per batch size,
time to first token, and, for batch 1, % of the weight-streaming bound from the measured
device-memory bandwidth. Needs CUDA.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.sampling_params import SamplingParams


def device_copy_bandwidth_gbs(num_bytes: int = 2 << 30) -> float:
    """Read+write bandwidth of a large device-to-device copy, in GB/s."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * num_bytes * 10 / (time.perf_counter() - start) / 1e9


def run_batch(engine: Engine, batch_size: int, prompt_len: int, output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(
            f"b{batch_size}-{i}", [(7 * i + j) % 1000 + 1 for j in range(prompt_len)], params
        )
    torch.cuda.synchronize()
    start = time.perf_counter()
    first_token_s = None
    num_tokens = 0
    while engine.has_unfinished_requests():
        deltas = engine.step()
        num_tokens += sum(len(d.new_token_ids) for d in deltas)
        if first_token_s is None and deltas:
            first_token_s = time.perf_counter() - start
    total_s = time.perf_counter() - start
    decode_tokens = num_tokens - batch_size
    return {
        "batch_size": batch_size,
        "ttft_ms": 1000 * first_token_s,
        "decode_tok_s": decode_tokens / (total_s - first_token_s),
        "step_ms": 1000 * (total_s - first_token_s) / (output_len - 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_decode needs a CUDA device")

    bandwidth = device_copy_bandwidth_gbs()
    engine = Engine(
        EngineConfig(
            model=args.model,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            max_model_len=2048,
            compile_decode=args.compile,
            gpu_memory_utilization=0.8,
        )
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    bound_tok_s = bandwidth * 1e9 / weight_bytes
    engine.warm_up()
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model} (dummy, bf16), "
        f"compile={args.compile}, copy bandwidth {bandwidth:.0f} GB/s, "
        f"weights {weight_bytes / 1e9:.2f} GB → bound {bound_tok_s:.0f} tok/s for one stream",
        "",
        "| batch | TTFT ms | decode step ms | decode tok/s | % of bound (batch 1) |",
        "|---|---|---|---|---|",
    ]
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        row = run_batch(engine, batch_size, args.prompt_len, args.output_len)
        bound = f"{100 * row['decode_tok_s'] / bound_tok_s:.0f}%" if batch_size == 1 else ""
        lines.append(
            f"| {batch_size} | {row['ttft_ms']:.1f} | {row['step_ms']:.2f} | "
            f"{row['decode_tok_s']:.0f} | {bound} |"
        )
        print(lines[-1], flush=True)
    report = "\n".join(lines)
    print(report)
    if args.output:
        args.output.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
