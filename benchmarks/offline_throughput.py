"""Offline throughput: nanoserve against transformers `generate` on the same checkpoint.

    python -m benchmarks.offline_throughput [--models tiny,0.6b] [--num-prompts 16]
        [--output-len 64] [--threads 2]

For each model (a dummy-weight bf16 Qwen3 checkpoint written once by nanoserve.bench.models, so both
arms read the very same safetensors) four arms run the same greedy prompts (~128 tokens, every
request runs exactly --output-len tokens):

    nanoserve x1      one request at a time through Engine.step()
    nanoserve x16     all prompts added at once (continuous batching)
    hf x1             transformers generate, one prompt at a time
    hf batch          transformers generate on one left-padded batch of all prompts

Per arm: output tokens/s over the whole run, time to first token (mean over requests) and the
median decode step (one new token for every running request). The machine's memory read
bandwidth is measured in the same run, so the 0.6B single-request decode is also given as a
percentage of its bound (weight bytes read per token / bandwidth). Results print as a table and
go to benchmarks/results/<date>-offline/offline_throughput.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanoserve.bench.models import ALLOWED_OUTPUT_IDS, decode_weight_bytes, make_dummy_checkpoint

MODELS = {"tiny": "tiny", "0.6b": "qwen3-0.6b"}  # --models name -> nanoserve.bench.models preset
RESULTS_DIR = Path(__file__).parent / "results"
DEFAULT_MODEL_CACHE = Path.home() / ".cache" / "nanoserve" / "bench-models"


@dataclass
class ArmResult:
    """What one arm measured over all its requests."""

    name: str
    num_requests: int
    output_tokens: int
    elapsed_s: float
    ttft_s: list[float] = field(default_factory=list)  # per request
    decode_step_s: list[float] = field(default_factory=list)  # every decode step of the run
    output_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def mean_ttft_s(self) -> float:
        return statistics.mean(self.ttft_s)

    @property
    def median_decode_step_s(self) -> float:
        return statistics.median(self.decode_step_s)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "output_tokens": self.output_tokens,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
            "mean_ttft_s": self.mean_ttft_s,
            "median_decode_step_s": self.median_decode_step_s,
        }


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_bandwidth_gb_s() -> dict[str, float]:
    """Read (sum) and copy bandwidth over 256 MB of bf16, medians of 7."""
    big = torch.ones(1 << 27, dtype=torch.bfloat16)
    dst = torch.empty_like(big)

    def median_s(fn) -> float:
        fn()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    nbytes = big.numel() * big.element_size()
    return {
        "read_gb_s": nbytes / median_s(big.sum) / 1e9,
        "copy_gb_s_read_plus_write": 2 * nbytes / median_s(lambda: dst.copy_(big)) / 1e9,
    }


def make_prompts(num_prompts: int, seed: int) -> list[list[int]]:
    """Random printable-byte prompts of 112-144 tokens (mean ~128)."""
    rng = random.Random(seed)
    return [
        [rng.choice(ALLOWED_OUTPUT_IDS) for _ in range(rng.randint(112, 144))]
        for _ in range(num_prompts)
    ]


# -- nanoserve ---------------------------------------------------------------------------------


def load_nanoserve(model_dir: Path, compile_decode: bool):
    from nanoserve.common.config import EngineConfig
    from nanoserve.engine_setup import build_engine

    config = EngineConfig(
        model=str(model_dir),
        dtype="bfloat16",
        device="cpu",
        max_model_len=512,
        max_num_seqs=64,
        compile_decode=compile_decode,
    )
    return build_engine(config)


def run_nanoserve(engine, name: str, prompts: list[list[int]], output_len: int, at_once: bool):
    """Run `prompts` through the engine, all at once or one after another, timing every step."""
    from nanoserve.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    groups = [list(range(len(prompts)))] if at_once else [[i] for i in range(len(prompts))]
    result = ArmResult(name, len(prompts), 0, 0.0, output_token_ids=[[] for _ in prompts])
    run_start = time.perf_counter()
    for group in groups:
        group_start = time.perf_counter()
        for i in group:
            engine.add_request(f"{name}-{i}", prompts[i], params)
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            deltas = engine.step()
            now = time.perf_counter()
            is_decode = True
            for delta in deltas:
                tokens = result.output_token_ids[int(delta.request_id.rsplit("-", 1)[1])]
                if not tokens:
                    result.ttft_s.append(now - group_start)
                    is_decode = False
                tokens.extend(delta.new_token_ids)
            if is_decode and deltas:
                result.decode_step_s.append(now - step_start)
    result.elapsed_s = time.perf_counter() - run_start
    result.output_tokens = sum(len(t) for t in result.output_token_ids)
    return result


# -- transformers ------------------------------------------------------------------------------


class _TokenClock:
    """A generate() streamer that only notes when each new token (batch) arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:  # the first put is the prompt itself
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_transformers(model_dir: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    return model.eval()


def _hf_generate(model, batch_prompts: list[list[int]], output_len: int):
    """Left-padded generate; returns (new token ids per prompt, token arrival times, start)."""
    pad_id = model.generation_config.pad_token_id
    longest = max(len(p) for p in batch_prompts)
    input_ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in batch_prompts])
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch_prompts])
    clock = _TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=output_len,
            do_sample=False,
            streamer=clock,
        )
    return out[:, longest:].tolist(), clock.times, start


def run_transformers(model, name: str, prompts: list[list[int]], output_len: int, batched: bool):
    groups = [prompts] if batched else [[p] for p in prompts]
    result = ArmResult(name, len(prompts), 0, 0.0)
    run_start = time.perf_counter()
    for group in groups:
        new_ids, times, start = _hf_generate(model, group, output_len)
        result.ttft_s.extend([times[0] - start] * len(group))
        result.decode_step_s.extend(b - a for a, b in zip(times, times[1:], strict=False))
        result.output_token_ids.extend(new_ids)
    result.elapsed_s = time.perf_counter() - run_start
    result.output_tokens = sum(len(t) for t in result.output_token_ids)
    return result


# -- one model ---------------------------------------------------------------------------------


def bench_model(name: str, args: argparse.Namespace, bandwidth: dict) -> dict:
    preset = MODELS[name]
    model_dir = make_dummy_checkpoint(args.model_cache / f"{preset}-seed{args.seed}", preset, 0)
    prompts = make_prompts(args.num_prompts, args.seed)
    single = prompts[: args.num_single or len(prompts)]
    warmup = make_prompts(2, args.seed + 1)
    arms: list[ArmResult] = []

    log(f"{name}: loading nanoserve")
    started = time.perf_counter()
    engine = load_nanoserve(model_dir, args.compile)
    run_nanoserve(engine, "warmup", warmup, 4, at_once=True)  # compiles, if any, happen here
    run_nanoserve(engine, "warmup", warmup[:1], 4, at_once=True)
    nanoserve_startup_s = time.perf_counter() - started
    log(f"{name}: nanoserve ready in {nanoserve_startup_s:.1f} s; x1 on {len(single)} prompts")
    arms.append(run_nanoserve(engine, "nanoserve x1", single, args.output_len, at_once=False))
    log(f"{name}: nanoserve x{len(prompts)}")
    arms.append(run_nanoserve(engine, f"nanoserve x{len(prompts)}", prompts, args.output_len, True))
    del engine

    log(f"{name}: loading transformers")
    model = load_transformers(model_dir)
    _hf_generate(model, warmup, 4)
    log(f"{name}: transformers x1 on {len(single)} prompts")
    arms.append(run_transformers(model, "hf x1", single, args.output_len, batched=False))
    log(f"{name}: transformers padded batch of {len(prompts)}")
    arms.append(run_transformers(model, f"hf batch {len(prompts)}", prompts, args.output_len, True))
    del model

    for arm in arms:
        lengths = {len(t) for t in arm.output_token_ids}
        if lengths != {args.output_len}:
            log(f"warning: {arm.name} produced output lengths {sorted(lengths)}")
    weight_bytes = decode_weight_bytes(model_dir)
    bound_tok_s = bandwidth["read_gb_s"] * 1e9 / weight_bytes
    return {
        "model": name,
        "preset": preset,
        "model_dir": str(model_dir),
        "decode_weight_bytes": weight_bytes,
        "bandwidth_bound_tok_s": bound_tok_s,
        "nanoserve_startup_s": nanoserve_startup_s,
        "greedy_match": _greedy_match(arms[0], arms[2]),
        "arms": [arm.summary() for arm in arms],
    }


def _greedy_match(ours: ArmResult, theirs: ArmResult) -> float:
    """Fraction of leading output tokens equal to transformers' (bf16 drifts, so < 1 is fine)."""
    matched = total = 0
    for a, b in zip(ours.output_token_ids, theirs.output_token_ids, strict=True):
        prefix = 0
        while prefix < min(len(a), len(b)) and a[prefix] == b[prefix]:
            prefix += 1
        matched += prefix
        total += len(b)
    return matched / total


# -- report ------------------------------------------------------------------------------------


def format_table(result: dict) -> str:
    arms = {arm["name"]: arm for arm in result["arms"]}
    names = list(arms)
    ns1, ns_batch, hf1, hf_batch = (arms[n] for n in names)
    lines = [
        f"## {result['model']} ({result['preset']}, {result['decode_weight_bytes'] / 1e9:.2f} GB"
        f" of weights per decode step; greedy match with hf x1: {result['greedy_match']:.0%})",
        "",
        "| arm | requests | output tok/s | mean TTFT (ms) | decode step (ms) |",
        "|---|---|---|---|---|",
    ]
    for arm in result["arms"]:
        lines.append(
            f"| {arm['name']} | {arm['num_requests']} | {arm['tokens_per_s']:.1f}"
            f" | {arm['mean_ttft_s'] * 1e3:.1f} | {arm['median_decode_step_s'] * 1e3:.2f} |"
        )
    single_tok_s = 1.0 / ns1["median_decode_step_s"]
    lines += [
        "",
        f"- nanoserve x1 vs hf x1: {ns1['tokens_per_s'] / hf1['tokens_per_s']:.2f}x tok/s,"
        f" decode step {hf1['median_decode_step_s'] / ns1['median_decode_step_s']:.2f}x faster",
        f"- {ns_batch['name']} vs hf x1: {ns_batch['tokens_per_s'] / hf1['tokens_per_s']:.2f}x;"
        f" vs {hf_batch['name']}: {ns_batch['tokens_per_s'] / hf_batch['tokens_per_s']:.2f}x",
        f"- single-request decode: {single_tok_s:.1f} tok/s ="
        f" {single_tok_s / result['bandwidth_bound_tok_s']:.0%} of the bandwidth bound"
        f" ({result['bandwidth_bound_tok_s']:.1f} tok/s); hf x1:"
        f" {1.0 / hf1['median_decode_step_s'] / result['bandwidth_bound_tok_s']:.0%}",
        f"- nanoserve start-up incl. warm-up: {result['nanoserve_startup_s']:.1f} s",
    ]
    return "\n".join(lines)


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(
            line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    import transformers

    return {
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,0.6b", help=f"comma list of {list(MODELS)}")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests in the batch arms")
    parser.add_argument(
        "--num-single",
        type=int,
        default=4,
        help="prompts the one-at-a-time arms run (the first ones; 0 = all)",
    )
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile", action="store_true", help="nanoserve's compiled decode step (compile_decode)"
    )
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_MODEL_CACHE)
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    args.model_names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.model_names if m not in MODELS]
    if unknown or not args.model_names:
        parser.error(f"--models takes a comma list of {list(MODELS)}, got {args.models!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log("measuring memory bandwidth")
    bandwidth = measure_bandwidth_gb_s()
    log(f"read {bandwidth['read_gb_s']:.1f} GB/s")
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.offline_throughput", *sys.argv[1:]]),
        "machine": machine_info(),
        "bandwidth": bandwidth,
        "args": {k: str(v) for k, v in vars(args).items()},
        "models": [],
    }
    for name in args.model_names:
        report["models"].append(bench_model(name, args, bandwidth))
        print(format_table(report["models"][-1]) + "\n", flush=True)

    output_dir = args.output_dir or RESULTS_DIR / f"{datetime.date.today().isoformat()}-offline"
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / f"offline_throughput-{time.strftime('%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(
        f"machine: {report['machine']['cpu']}, {args.threads} threads, torch"
        f" {report['machine']['torch']}; read bandwidth {bandwidth['read_gb_s']:.1f} GB/s"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
