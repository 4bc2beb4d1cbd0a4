"""The GPU benchmark of scripts/gpu_check.sh: nanoserve beside transformers on one GPU, one run.

    python -m benchmarks.gpu_bench --out gpu-results                  # Qwen3-1.7B shape, CUDA
    python -m benchmarks.gpu_bench --preset tiny --device cpu --out /tmp/x   # a rehearsal

On a dummy-weight checkpoint of the preset's shape (bf16, written once to --model-dir, the same
files for every arm) it measures, in order: the device's copy bandwidth; nanoserve in-process
(single-stream decode and its % of the weight-streaming bound, TTFT at 128 and 2,048 prompt
tokens, throughput at 8, 32 and 128 concurrent requests, CUDA-graph capture time, the tokens
its KV pool holds); the same engine with an FP8 KV cache (`--kv-cache-dtype fp8`: the tokens
its pool holds, single stream, 32 concurrent, greedy tokens against the bf16 cache's);
transformers `generate` (one request at a time, and padded batches of 8 and 32); then
`nanoserve serve` with 32 concurrent streaming clients. After every stage it rewrites
`gpu-<date>.json` and `gpu-table.md` in --out, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from nanoserve.bench.arms import free_port
from nanoserve.bench.client import completion_body, run_phase
from nanoserve.bench.metrics import summarize
from nanoserve.bench.models import ALLOWED_OUTPUT_IDS, decode_weight_bytes, make_dummy_checkpoint
from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.engine import Engine
from nanoserve.engine_setup import build_engine

CONCURRENCY = (8, 32, 128)
PROMPT_LEN, OUTPUT_LEN = 128, 128
SINGLE_OUTPUT_LEN = 256
TTFT_PROMPT_LENS = (128, 2048)
SERVE_CLIENTS = 32


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Read + write bandwidth of a large on-device copy."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    synchronize(device)
    return 2 * num_bytes * 10 / (time.perf_counter() - started) / 1e9


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """Printable-byte prompts that share no prefix (no prefix-cache hits between them)."""
    rng = random.Random(seed)
    return [[rng.choice(ALLOWED_OUTPUT_IDS) for _ in range(length)] for _ in range(num)]


# -- nanoserve, in-process ------------------------------------------------------------------


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every prompt at once, greedy, to `max_tokens`; first-token and total times."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prefix = f"r{time.monotonic_ns()}-"
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)
    started = time.perf_counter()
    first_token_s = None
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        if first_token_s is None and tokens:
            first_token_s = time.perf_counter() - started
    total_s = time.perf_counter() - started
    outputs = [tokens[f"{prefix}{i}"] for i in range(len(prompts))]
    return {"first_token_s": first_token_s, "total_s": total_s, "outputs": outputs}


def bench_nanoserve(model_dir: Path, device: torch.device, seed: int) -> dict:
    started = time.perf_counter()
    engine = build_engine(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            device=device.type,
            max_model_len=4096,
            max_num_seqs=max(CONCURRENCY),
            gpu_memory_utilization=0.8,
        )
    )
    engine.warm_up()
    result: dict = {"startup_s": time.perf_counter() - started}
    graphs = [r for r in engine.runner.step_runners if hasattr(r, "capture_time_s")]
    result["graph_capture_s"] = graphs[0].capture_time_s if graphs else 0.0
    result["attention_backend"] = engine.kv_cache.backend.name
    result["kv_tokens"] = engine.kv_cache.num_blocks * engine.kv_cache.block_size
    single = run_engine(engine, random_prompts(1, PROMPT_LEN, seed), SINGLE_OUTPUT_LEN)
    decode_s = single["total_s"] - single["first_token_s"]
    result["single_stream_tok_s"] = (SINGLE_OUTPUT_LEN - 1) / decode_s
    result["single_stream_tokens"] = single["outputs"][0]
    for length in TTFT_PROMPT_LENS:
        runs = [run_engine(engine, random_prompts(1, length, seed + 1 + r), 1) for r in range(5)]
        result[f"ttft_ms_{length}"] = 1000 * sorted(r["first_token_s"] for r in runs)[2]
    for concurrency in CONCURRENCY:
        run = run_engine(engine, random_prompts(concurrency, PROMPT_LEN, seed + 10), OUTPUT_LEN)
        result[f"throughput_tok_s_{concurrency}"] = concurrency * OUTPUT_LEN / run["total_s"]
        log(f"nanoserve {concurrency} concurrent: {result[f'throughput_tok_s_{concurrency}']:.0f}")
    del engine
    return result


def bench_fp8_kv(model_dir: Path, device: torch.device, seed: int) -> dict:
    """The FP8-KV row: the same engine, its KV cache in float8_e4m3fn (scales 1.0)."""
    engine = build_engine(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            device=device.type,
            max_model_len=4096,
            max_num_seqs=max(CONCURRENCY),
            gpu_memory_utilization=0.8,
            kv_cache_dtype="fp8",
        )
    )
    engine.warm_up()
    result: dict = {"kv_tokens": engine.kv_cache.num_blocks * engine.kv_cache.block_size}
    result["attention_backend"] = engine.kv_cache.backend.name
    single = run_engine(engine, random_prompts(1, PROMPT_LEN, seed), SINGLE_OUTPUT_LEN)
    result["single_stream_tok_s"] = (SINGLE_OUTPUT_LEN - 1) / (
        single["total_s"] - single["first_token_s"]
    )
    result["single_stream_tokens"] = single["outputs"][0]
    run = run_engine(engine, random_prompts(32, PROMPT_LEN, seed + 10), OUTPUT_LEN)
    result["throughput_tok_s_32"] = 32 * OUTPUT_LEN / run["total_s"]
    log(f"nanoserve, fp8 KV cache, 32 concurrent: {result['throughput_tok_s_32']:.0f}")
    del engine
    return result


# -- transformers generate ------------------------------------------------------------------


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, device) -> tuple:
    ids = torch.tensor(prompts, device=device)
    synchronize(device)
    started = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
    )
    synchronize(device)
    return time.perf_counter() - started, out[:, ids.shape[1] :].tolist()


def bench_transformers(model_dir: Path, device: torch.device, seed: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(device).eval()
    hf_generate(model, random_prompts(1, 16, seed), 4, device)  # warm-up
    result: dict = {}
    one_s, _ = hf_generate(model, random_prompts(1, PROMPT_LEN, seed), 1, device)
    total_s, outputs = hf_generate(
        model, random_prompts(1, PROMPT_LEN, seed), SINGLE_OUTPUT_LEN, device
    )
    result["single_stream_tok_s"] = (SINGLE_OUTPUT_LEN - 1) / (total_s - one_s)
    result["single_stream_tokens"] = outputs[0]
    for length in TTFT_PROMPT_LENS:
        runs = [
            hf_generate(model, random_prompts(1, length, seed + 1 + r), 1, device)[0]
            for r in range(3)
        ]
        result[f"ttft_ms_{length}"] = 1000 * sorted(runs)[1]
    for batch in (8, 32):
        elapsed, _ = hf_generate(
            model, random_prompts(batch, PROMPT_LEN, seed + 10), OUTPUT_LEN, device
        )
        result[f"padded_batch_tok_s_{batch}"] = batch * OUTPUT_LEN / elapsed
        log(f"transformers padded batch {batch}: {result[f'padded_batch_tok_s_{batch}']:.0f}")
    del model
    return result


# -- the real server ------------------------------------------------------------------------


def bench_server(model_dir: Path, device: torch.device, out_dir: Path) -> dict:
    """`nanoserve serve` on this device and SERVE_CLIENTS concurrent streaming clients."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "nanoserve.cli.main",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--device",
        device.type,
        "--max-model-len",
        "4096",
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
    ]
    with open(out_dir / "gpu-serve.log", "wb") as server_log:
        server = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT)
    try:
        started = time.perf_counter()
        _wait_healthy(f"http://127.0.0.1:{port}", server, timeout_s=240)
        ready_s = time.perf_counter() - started
        rng = random.Random(0)
        bodies = [
            completion_body(
                "bench",
                "".join(rng.choice("abcdefgh ") for _ in range(PROMPT_LEN)),
                OUTPUT_LEN,
                ignore_eos=True,
            )
            for _ in range(SERVE_CLIENTS)
        ]
        url = f"http://127.0.0.1:{port}/v1/completions"
        results, duration_s = asyncio.run(
            run_phase(url, bodies, SERVE_CLIENTS, float("inf"), 0, 300.0, "serve")
        )
        summary = summarize(results, duration_s)
        return {
            "ready_s": ready_s,
            **{
                k: summary[k]
                for k in (
                    "num_completed",
                    "num_errors",
                    "errors",
                    "output_throughput",
                    "ttft_ms",
                    "itl_ms",
                )
            },
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


def _wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} (see gpu-serve.log)")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not healthy after {timeout_s} s")


# -- the report -----------------------------------------------------------------------------


def goals(doc: dict) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met) for issue 15's goals, from what the run measured so far."""
    ours, hf = doc.get("nanoserve", {}), doc.get("transformers", {})
    rows: list[tuple[str, str, bool | None]] = []
    if "single_stream_tok_s" in ours:
        share = ours["single_stream_tok_s"] / doc["bound_tok_s"]
        rows.append(("single-stream decode ≥ 60% of the HBM bound", f"{share:.0%}", share >= 0.6))
    if "throughput_tok_s_32" in ours and "padded_batch_tok_s_32" in hf:
        one = ours["throughput_tok_s_32"] / hf["single_stream_tok_s"]
        padded = ours["throughput_tok_s_32"] / hf["padded_batch_tok_s_32"]
        rows.append(("32 concurrent ≥ 10× hf one at a time", f"{one:.1f}×", one >= 10))
        rows.append(("32 concurrent ≥ 2× hf padded batch", f"{padded:.1f}×", padded >= 2))
    if "ttft_ms_2048" in ours:
        ttft = ours["ttft_ms_2048"]
        rows.append(("TTFT of a 2,048-token prompt ≤ 30 ms", f"{ttft:.1f} ms", ttft <= 30))
    if ours.get("graph_capture_s"):
        capture = ours["graph_capture_s"]
        rows.append(("CUDA-graph capture ≤ 20 s", f"{capture:.1f} s", capture <= 20))
    return rows


def markdown(doc: dict) -> str:
    ours, hf = doc.get("nanoserve", {}), doc.get("transformers", {})

    def cell(arm: dict, key: str, digits: int = 0) -> str:
        return f"{arm[key]:,.{digits}f}" if key in arm else "—"

    lines = [
        f"{doc['device_name']}, torch {doc['torch']}, {doc['preset']} shape (dummy weights, bf16), "
        f"{doc['date']}; copy bandwidth {doc['bandwidth_gb_s']:,.0f} GB/s, "
        f"{doc['weight_bytes'] / 1e9:.2f} GB of weights per decode step → "
        f"bound {doc['bound_tok_s']:,.0f} tok/s for one stream",
        "",
        "| measure | nanoserve | transformers |",
        "|---|---|---|",
        f"| single stream tok/s | {cell(ours, 'single_stream_tok_s')} | "
        f"{cell(hf, 'single_stream_tok_s')} |",
    ]
    for length in TTFT_PROMPT_LENS:
        key = f"ttft_ms_{length}"
        lines.append(
            f"| TTFT ms, {length} prompt tokens | {cell(ours, key, 1)} | {cell(hf, key, 1)} |"
        )
    for n in CONCURRENCY:
        hf_cell = cell(hf, f"padded_batch_tok_s_{n}") if n != 128 else "—"
        lines.append(
            f"| {n} concurrent, output tok/s (hf: padded batch) | "
            f"{cell(ours, f'throughput_tok_s_{n}')} | {hf_cell} |"
        )
    lines.append(f"| CUDA-graph capture s | {cell(ours, 'graph_capture_s', 1)} | — |")
    lines.append(f"| KV cache tokens | {cell(ours, 'kv_tokens')} | — |")
    if "greedy_match" in doc:
        lines.append(f"| greedy tokens equal (single stream) | {doc['greedy_match']:.0%} | |")
    lines += fp8_kv_lines(ours, doc.get("fp8_kv", {}), doc.get("fp8_kv_greedy_match"))
    if "serve" in doc:
        serve = doc["serve"]
        lines += [
            "",
            f"`nanoserve serve`, {SERVE_CLIENTS} streaming clients: "
            f"{serve['output_throughput']:,.0f} output tok/s, TTFT p50 "
            f"{serve['ttft_ms']['p50']:.1f} ms, {serve['num_errors']} errors, "
            f"ready in {serve['ready_s']:.1f} s",
        ]
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    lines += [
        f"| {goal} | {measured} | {'yes' if met else 'no'} |" for goal, measured, met in goals(doc)
    ]
    return "\n".join(lines) + "\n"


def fp8_kv_lines(ours: dict, fp8: dict, greedy: float | None) -> list[str]:
    """The FP8-KV row against nanoserve's bf16 cache: tokens held, one stream, 32 at once."""
    if not fp8:
        return []

    def ratio(key: str) -> str:
        return f" ({fp8[key] / ours[key]:.2f}×)" if ours.get(key) else ""

    same = f", greedy tokens equal to the bf16 cache's {greedy:.0%}" if greedy is not None else ""
    return [
        "",
        f"FP8 KV cache (`--kv-cache-dtype fp8`, {fp8['attention_backend']}){same}:",
        "",
        "| KV cache tokens | single stream tok/s | 32 concurrent, output tok/s |",
        "|---|---|---|",
        f"| {fp8['kv_tokens']:,}{ratio('kv_tokens')} | {fp8['single_stream_tok_s']:,.0f}"
        f"{ratio('single_stream_tok_s')} | {fp8['throughput_tok_s_32']:,.0f}"
        f"{ratio('throughput_tok_s_32')} |",
    ]


def write(doc: dict, out_dir: Path) -> None:
    (out_dir / f"gpu-{doc['date']}.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "gpu-table.md").write_text(markdown(doc))


def greedy_match(ours: list[int], theirs: list[int]) -> float:
    """The share of positions before the first difference (bf16 may legitimately diverge)."""
    pairs = zip(ours, theirs, strict=False)  # equal lengths unless a run was cut short
    same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(ours))
    return same / max(1, len(ours))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/nanoserve-gpu-bench"))
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--skip", default="", help="comma list of stages to skip: hf,serve,fp8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = make_dummy_checkpoint(args.model_dir / args.preset, args.preset, args.seed)
    on_cuda = device.type == "cuda"
    doc: dict = {
        "date": datetime.date.today().isoformat(),
        "preset": args.preset,
        "device_name": torch.cuda.get_device_name() if on_cuda else platform.processor(),
        "torch": torch.__version__,
        "bandwidth_gb_s": copy_bandwidth_gb_s(device),
        "weight_bytes": decode_weight_bytes(model_dir),
    }
    doc["bound_tok_s"] = doc["bandwidth_gb_s"] * 1e9 / doc["weight_bytes"]
    stages = [
        ("nanoserve", bench_nanoserve),
        ("fp8_kv", bench_fp8_kv),
        ("transformers", bench_transformers),
    ]
    for name, stage in stages:
        if name[:2] in args.skip:
            continue
        log(f"{name} ...")
        doc[name] = stage(model_dir, device, args.seed)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write(doc, args.out)
    if "nanoserve" in doc and "fp8_kv" in doc:
        tokens = doc["nanoserve"]["single_stream_tokens"], doc["fp8_kv"].pop("single_stream_tokens")
        doc["fp8_kv_greedy_match"] = greedy_match(*tokens)
    if "nanoserve" in doc and "transformers" in doc:
        tokens = (
            doc["nanoserve"].pop("single_stream_tokens"),
            doc["transformers"].pop("single_stream_tokens"),
        )
        doc["greedy_match"] = greedy_match(*tokens)
    if "serve" not in args.skip:
        log("nanoserve serve ...")
        doc["serve"] = bench_server(model_dir, device, args.out)
    write(doc, args.out)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
