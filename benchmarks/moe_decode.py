"""A Qwen3-30B-A3B-shaped MoE model with fewer layers, dummy weights, bf16 against int8: one run.

    python -m benchmarks.moe_decode --layers 4              # bf16 and int8, side by side
    python -m benchmarks.moe_decode --layers 4 --arms bf16  # one arm

Each arm runs in its own process (its peak memory is its own): the engine is built from the
`Qwen/Qwen3-30B-A3B` preset with `num_hidden_layers` cut to `--layers` (every layer keeps the
real shape: 128 experts of 3 x 2048 x 768, top 8, 32 query / 4 KV heads, the 151,936-token
vocabulary), then it measures

    start-up       building the engine: dummy weights, linear and MoE methods, KV cache, warm-up
    decode         one request, `--decode-tokens` greedy tokens: tok/s of the decode steps
    % of bound     decode tok/s x active bytes per token / read bandwidth measured in this run;
                   active bytes = attention + router weights of every layer, the 8 chosen
                   experts' 3 matrices of every layer, and the LM head (the embedding reads a row)
    8 streams      8 requests at once, `--decode-tokens` each: generated tok/s
    prefill        one 1,500-token prompt: tok/s of its prefill (one step)
    peak memory    the process's maximum resident set

The machine's read bandwidth is probed (`measure_read_bandwidth_gb_s`: 256 MB read) right before
and right after each arm's single-stream decode, and the share is taken against their mean: on a
shared virtual machine the bandwidth drifts from minute to minute, so a probe taken before the
engine's start-up can describe another state of the machine than the decode's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESET = "Qwen/Qwen3-30B-A3B"


def model_dir(layers: int, root: Path) -> Path:
    """The preset's dummy checkpoint directory with `layers` layers."""
    from nanoserve.common.checkpoint import make_dummy_model_dir

    source = make_dummy_model_dir(PRESET, cache_dir=root)
    target = root / f"qwen3-30b-a3b-{layers}-layers"
    if not target.exists():
        target.mkdir()
        for file in source.iterdir():
            (target / file.name).write_bytes(file.read_bytes())
        config = json.loads((target / "config.json").read_text())
        config["num_hidden_layers"] = layers
        (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def active_bytes_per_token(model) -> int:
    """Weights one decode token reads: attention and router of every layer, the top-k experts'
    matrices, the LM head (quantized ones at their stored size, scales included)."""
    from nanoserve.moe.layer import SparseMoeBlock

    total = 0
    for layer in model.model.layers:
        attention = layer.self_attn
        for linear in (attention.qkv_proj, attention.o_proj):
            total += linear_bytes(linear)
        block = layer.mlp
        assert isinstance(block, SparseMoeBlock)
        total += block.gate.numel() * block.gate.element_size()
        total += block.top_k * expert_bytes(block)
    return total + linear_bytes(model.lm_head)


def linear_bytes(linear) -> int:
    weight = getattr(linear, "int8_weight", None)
    if weight is not None:
        return weight.numel() + linear.int8_scales.numel() * linear.int8_scales.element_size()
    weight = linear.weight if linear.weight is not None else linear.packed_weight  # packed only
    return weight.numel() * weight.element_size()


def expert_bytes(block) -> int:
    """One expert's three matrices (gate, up, down), as stored."""
    if block.w13 is not None:
        return (block.w13[0].numel() + block.w2[0].numel()) * block.w13.element_size()
    w13, w2 = block.int8_w13, block.int8_w2
    return sum(q.values[0].numel() + q.scales[0].numel() * 4 for q in (w13, w2))


def run_arm(arm: str, layers: int, decode_tokens: int, root: Path) -> dict:
    import torch

    from nanoserve.bench.machine import measure_read_bandwidth_gb_s
    from nanoserve.common.config import EngineConfig
    from nanoserve.common.sampling_params import SamplingParams
    from nanoserve.engine_setup import build_engine

    threads = torch.get_num_threads()
    started = time.perf_counter()
    config = EngineConfig(
        model=str(model_dir(layers, root)),
        load_format="dummy",
        dtype="bfloat16",
        device="cpu",
        quantization="int8" if arm == "int8" else None,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=8,
        kv_cache_memory=256 << 20,
    )
    engine = build_engine(config)
    engine.warm_up()
    startup_s = time.perf_counter() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)

    def generate(prompts: list[list[int]]) -> tuple[float, float, int]:
        """(seconds of the first step, seconds of the rest, tokens generated)."""
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{arm}-{time.monotonic_ns()}-{i}", prompt, greedy)
        first = time.perf_counter()
        num_tokens = sum(len(d.new_token_ids) for d in engine.step())
        rest = time.perf_counter()
        while engine.has_unfinished_requests():
            num_tokens += sum(len(d.new_token_ids) for d in engine.step())
        return rest - first, time.perf_counter() - rest, num_tokens

    probe_before, _ = measure_read_bandwidth_gb_s(threads)
    _, decode_s, tokens = generate([[7, 8, 9, 10]])
    probe_after, _ = measure_read_bandwidth_gb_s(threads)
    bandwidth = (probe_before + probe_after) / 2  # this VM's bandwidth drifts minute by minute
    decode_tok_s = (tokens - 1) / decode_s
    active = active_bytes_per_token(engine.model)
    first_s, rest_s, tokens8 = generate([[11 + i, 12, 13] for i in range(8)])
    prefill_s, _, _ = generate([[(5 * i) % 256 for i in range(1500)]])
    return {
        "arm": arm,
        "layers": layers,
        "threads": threads,
        "read_bandwidth_gb_s": round(bandwidth, 1),
        "probes_gb_s": [round(probe_before, 1), round(probe_after, 1)],
        "startup_s": round(startup_s, 1),
        "decode_tok_s": round(decode_tok_s, 2),
        "active_mb_per_token": round(active / 1e6, 1),
        "share_of_bound": round(decode_tok_s * active / (bandwidth * 1e9), 3),
        "eight_streams_tok_s": round(tokens8 / (first_s + rest_s), 2),
        "prefill_1500_tok_s": round(1500 / prefill_s, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "load_average": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--arms", default="bf16,int8")
    parser.add_argument("--one-arm", help=argparse.SUPPRESS)  # the child process of an arm
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "nanoserve-moe"))
    args = parser.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    if args.one_arm:
        print(json.dumps(run_arm(args.one_arm, args.layers, args.decode_tokens, root)))
        return
    rows = []
    for arm in args.arms.split(","):
        command = [sys.executable, "-m", "benchmarks.moe_decode", "--one-arm", arm]
        command += ["--layers", str(args.layers), "--decode-tokens", str(args.decode_tokens)]
        command += ["--root", str(root)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(output.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if len(rows) == 2:
        ratio = rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"]
        print(f"{rows[1]['arm']} / {rows[0]['arm']} single-stream decode: {ratio:.2f}x")


if __name__ == "__main__":
    main()
