"""The GPU benchmark of scripts/gpu_check.sh: nanoserve beside transformers on one GPU, one run.

    python -m benchmarks.gpu_bench --out gpu-results                  # Qwen3-1.7B shape, CUDA
    python -m benchmarks.gpu_bench --preset tiny --device cpu --out /tmp/x   # a rehearsal

On a dummy-weight checkpoint of the preset's shape (bf16, written once to --model-dir, the same
files for every arm) it measures, in order: the device's copy bandwidth; nanoserve in-process
(single-stream decode and its % of the weight-streaming bound, TTFT at 128 and 2,048 prompt
tokens, throughput at 8, 32 and 128 concurrent requests, CUDA-graph capture time, the tokens
its KV pool holds); the same engine with an FP8 KV cache (`--kv-cache-dtype fp8`: the tokens
its pool holds, single stream, 32 concurrent, greedy tokens against the bf16 cache's);
transformers `generate` (one request at a time, and padded batches of 8 and 32); speculative
decoding (one stream of an editing-shaped prompt with no drafts, n-gram drafts and a draft
model of the next smaller shape, k = 3, and a verify step's cost against a one-token step);
then `nanoserve serve` with 32 concurrent streaming clients; last, a Qwen3-30B-A3B-shaped MoE
model (the MoE row: dummy bf16 weights, all 48 layers on a GPU, a shrunk cousin in the CPU
rehearsal). After every stage it rewrites
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
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.core.engine import Engine
from nanoserve.engine_setup import build_engine

CONCURRENCY = (8, 32, 128)
PROMPT_LEN, OUTPUT_LEN = 128, 128
SINGLE_OUTPUT_LEN = 256
TTFT_PROMPT_LENS = (128, 2048)
SERVE_CLIENTS = 32
DRAFT_PRESETS = {"qwen3-1.7b": "qwen3-0.6b", "tiny": "test"}  # a draft shape per target shape
NUM_SPECULATIVE_TOKENS = 3


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


# -- speculative decoding ---------------------------------------------------------------------


def editing_prompt(seed: int) -> list[int]:
    """An editing-shaped prompt: a 'file' of allowed tokens, then its first half again."""
    rng = random.Random(seed)
    body = [rng.choice(ALLOWED_OUTPUT_IDS) for _ in range(PROMPT_LEN)]
    return body + body[: PROMPT_LEN // 2]


def bench_speculative(model_dir: Path, draft_dir: Path, device: torch.device, seed: int) -> dict:
    """Single-stream decode of the editing prompt with no drafts, n-gram and a draft model,
    and the cost of a step verifying k + 1 tokens against a one-token step."""
    arms = {
        "none": None,
        "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        "draft_model": {"model": str(draft_dir)},
    }
    result: dict = {}
    for name, spec in arms.items():
        if spec is not None:
            spec = SpeculativeConfig.from_dict(spec | {"num_speculative_tokens": 3})
        engine = build_engine(
            EngineConfig(
                model=str(model_dir),
                dtype="bfloat16",
                device=device.type,
                max_model_len=4096,
                max_num_seqs=8,
                gpu_memory_utilization=0.4,
                speculative_config=spec,
            )
        )
        engine.warm_up()
        run = run_engine(engine, [editing_prompt(seed)], SINGLE_OUTPUT_LEN)
        result[f"{name}_tok_s"] = (SINGLE_OUTPUT_LEN - 1) / (run["total_s"] - run["first_token_s"])
        stats = engine.stats().spec_decode
        if stats is not None and stats.num_draft_tokens:
            result[f"{name}_acceptance"] = stats.num_accepted_tokens / stats.num_draft_tokens
        if name == "ngram":
            result["verify_cost_ratio"] = verify_cost_ratio(engine, seed)
        log(f"speculative {name}: {result[f'{name}_tok_s']:.0f} tok/s")
        engine.shutdown()
        del engine
        gc.collect()
    return result


def verify_cost_ratio(engine: Engine, seed: int) -> float:
    """Median step time verifying k drafts (k + 1 tokens) over a one-token step's."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    engine.add_request("cost", random_prompts(1, 512, seed)[0], params)
    engine.step()
    request = engine.scheduler.requests["cost"]
    times: dict[int, list[float]] = {0: [], NUM_SPECULATIVE_TOKENS: []}
    for _ in range(10):
        for k, values in times.items():
            request.spec_token_ids = random_prompts(1, k, seed)[0] if k else []
            started = time.perf_counter()
            engine.step()
            values.append(time.perf_counter() - started)
    engine.abort(["cost"])
    return sorted(times[NUM_SPECULATIVE_TOKENS])[5] / sorted(times[0])[5]


# -- a mixture-of-experts model, in-process ---------------------------------------------------

MOE_PRESET = "Qwen/Qwen3-30B-A3B"
# The rehearsal's MoE shape (a CPU runs it): Qwen3-30B-A3B's structure, every size shrunk.
TINY_MOE = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "moe_intermediate_size": 128,
    "num_experts_per_tok": 4,
    "vocab_size": 512,
}


def moe_model_dir(root: Path, tiny: bool) -> Path:
    """The Qwen3-30B-A3B preset's dummy checkpoint (all 48 layers), or its tiny cousin."""
    from nanoserve.common.checkpoint import make_dummy_model_dir
    from nanoserve.text.byte_tokenizer import save_byte_level_tokenizer

    source = make_dummy_model_dir(MOE_PRESET, cache_dir=root)
    if not tiny:
        return source
    target = root / "tiny-moe"
    target.mkdir(parents=True, exist_ok=True)
    config = {**json.loads((source / "config.json").read_text()), **TINY_MOE}
    (target / "config.json").write_text(json.dumps(config))
    save_byte_level_tokenizer(target, model_max_length=4096, vocab_size=TINY_MOE["vocab_size"])
    return target


def bench_moe(model_dir: Path, device: torch.device, seed: int, bandwidth_gb_s: float) -> dict:
    """Qwen3-30B-A3B (dummy bf16 weights): start-up, single-stream decode against the bound
    of the bytes a token reads (attention, router, the 8 chosen experts, the LM head), 32
    concurrent requests, CUDA-graph capture."""
    from benchmarks.moe_decode import active_bytes_per_token

    started = time.perf_counter()
    engine = build_engine(
        EngineConfig(
            model=str(model_dir),
            load_format="dummy",
            dtype="bfloat16",
            device=device.type,
            max_model_len=4096,
            max_num_seqs=32,
            gpu_memory_utilization=0.8,
        )
    )
    engine.warm_up()
    result: dict = {"startup_s": time.perf_counter() - started}
    graphs = [r for r in engine.runner.step_runners if hasattr(r, "capture_time_s")]
    result["graph_capture_s"] = graphs[0].capture_time_s if graphs else 0.0
    result["moe_method"] = type(engine.model.moe_blocks()[0].method).__name__
    single = run_engine(engine, random_prompts(1, PROMPT_LEN, seed), SINGLE_OUTPUT_LEN)
    decode_s = single["total_s"] - single["first_token_s"]
    result["single_stream_tok_s"] = (SINGLE_OUTPUT_LEN - 1) / decode_s
    result["active_bytes"] = active_bytes_per_token(engine.model)
    bound = bandwidth_gb_s * 1e9 / result["active_bytes"]
    result["share_of_bound"] = result["single_stream_tok_s"] / bound
    run = run_engine(engine, random_prompts(32, PROMPT_LEN, seed + 10), OUTPUT_LEN)
    result["throughput_tok_s_32"] = 32 * OUTPUT_LEN / run["total_s"]
    log(f"MoE: {result['single_stream_tok_s']:.0f} tok/s one stream ({result['moe_method']})")
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
    if "speculative" in doc:
        lines += ["", *speculative_rows(doc["speculative"])]
    if "moe" in doc:
        moe = doc["moe"]
        lines += [
            "",
            f"MoE row, {MOE_PRESET} shape (dummy bf16, {moe['moe_method']}): "
            f"{moe['single_stream_tok_s']:,.0f} tok/s one stream "
            f"({moe['share_of_bound']:.0%} of the bound of {moe['active_bytes'] / 1e9:.2f} GB "
            f"read per token), {moe['throughput_tok_s_32']:,.0f} tok/s at 32 concurrent, "
            f"start-up {moe['startup_s']:.0f} s, CUDA-graph capture {moe['graph_capture_s']:.1f} s",
        ]
    if "moe_error" in doc:
        lines += ["", f"MoE row: the stage failed ({doc['moe_error']})"]
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    lines += [
        f"| {goal} | {measured} | {'yes' if met else 'no'} |" for goal, measured, met in goals(doc)
    ]
    return "\n".join(lines) + "\n"


def speculative_rows(spec: dict) -> list[str]:
    """The speculative stage as a table: tok/s and acceptance per arm, the verify cost."""
    base = spec.get("none_tok_s")
    rows = ["| speculative, editing prompt, one stream | tok/s | vs none | acceptance |"]
    rows.append("|---|---|---|---|")
    for arm in ("none", "ngram", "draft_model"):
        if f"{arm}_tok_s" not in spec:
            continue
        rate = spec[f"{arm}_tok_s"]
        ratio = f"{rate / base:.2f}×" if base else "—"
        accepted = spec.get(f"{arm}_acceptance")
        rows.append(
            f"| {arm} | {rate:,.0f} | {ratio} | {'—' if accepted is None else f'{accepted:.0%}'} |"
        )
    if "verify_cost_ratio" in spec:
        ratio = spec["verify_cost_ratio"]
        rows.append(f"| a step verifying 3 drafts, vs a one-token step | | {ratio:.2f}× | |")
    return rows


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
    parser.add_argument(
        "--skip", default="", help="comma list of stages to skip: hf,fp8,spec,serve,moe"
    )
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
    if "spec" not in args.skip and args.preset in DRAFT_PRESETS:
        log("speculative decoding ...")
        draft = DRAFT_PRESETS[args.preset]
        draft_dir = make_dummy_checkpoint(args.model_dir / draft, draft, args.seed)
        doc["speculative"] = bench_speculative(model_dir, draft_dir, device, args.seed)
        write(doc, args.out)
    if "serve" not in args.skip:
        log("nanoserve serve ...")
        doc["serve"] = bench_server(model_dir, device, args.out)
        write(doc, args.out)
    if "moe" not in args.skip:  # last: a stage cut short by the time limit loses only its row
        log("nanoserve, a mixture-of-experts model ...")
        moe_dir = moe_model_dir(args.model_dir / "moe", tiny=args.preset == "tiny")
        try:  # a failure is written down: in the table, and as the exit code
            doc["moe"] = bench_moe(moe_dir, device, args.seed, doc["bandwidth_gb_s"])
        except Exception as error:  # noqa: BLE001 (any failure of the stage, written down)
            doc["moe_error"] = f"{type(error).__name__}: {error}"
            log(f"the MoE stage failed: {doc['moe_error']}")
        gc.collect()
        write(doc, args.out)
    write(doc, args.out)
    print(markdown(doc))
    return 1 if "moe_error" in doc else 0


if __name__ == "__main__":
    raise SystemExit(main())
