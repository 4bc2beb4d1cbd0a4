"""What an FP8 KV cache costs and gives, against the model-dtype (bf16) cache, on CPU.

    python -m benchmarks.kv_cache_fp8                      # every part, a few minutes
    python -m benchmarks.kv_cache_fp8 --parts speed        # one part

quality   held-out bits/byte of the demo model (`benchmarks.quantization_quality`'s windows, in
          one pass and in 8-token steps that read the cache back), and the mean |Δ logprob| of
          teacher-forced prompt tokens of the Qwen3-0.6B shape (random weights), each cache
          dtype against bf16, with scales 1.0 and measured (--calculate-kv-scales)
capacity  tokens the same --kv-cache-memory holds for the 0.6B shape, and how many 2,048-token
          requests (16 new tokens each) run at once before the first preemption (tiny model:
          the scheduler's count depends on bytes per token only)
speed     one decode step (forward and logits, batch 1) of the 0.6B shape at 512, 2,048 and
          8,192 tokens of context, the bf16 and the FP8 cache bound in turn to the same model,
          alternating in rounds: a busy machine slows both alike, and the ratio is the result
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.quantization_quality import DECODE_STEP, bits_per_byte, heldout_texts, windows
from nanoserve.common.checkpoint import DEMO_MODEL_DIR
from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.core.engine import Engine
from nanoserve.core.step_layout import StepLayout
from nanoserve.engine_setup import build_engine
from nanoserve.quantization.kv_cache_fp8 import KV_CACHE_DTYPES, Fp8KVAttention, KVScales
from nanoserve.text.tokenizer import load_tokenizer
from tests.tiny_checkpoints import make_tiny_checkpoint

SHAPE = "Qwen/Qwen3-0.6B"
CACHES = {  # name -> (kv_cache_dtype, calculate_kv_scales)
    "bf16": ("auto", False),
    "fp8 (e4m3), scales 1.0": ("fp8", False),
    "fp8 (e4m3), measured scales": ("fp8", True),
    "fp8_e5m2, scales 1.0": ("fp8_e5m2", False),
}


def engine_for(model: str, cache: str, **settings) -> Engine:
    kv_cache_dtype, calculate = CACHES[cache]
    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=calculate,
        **settings,
    )
    return build_engine(config)


@torch.inference_mode()
def prompt_logprobs(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i + 1] | tokens[: i + 1]) for every i, in one prompt pass: [n - 1]."""
    model, backend, block_size = engine.model, engine.kv_cache.backend, engine.kv_cache.block_size
    n = len(tokens)
    layout = StepLayout(
        slot_mapping=list(range(n)),
        query_lens=[n],
        seq_lens=[n],
        block_tables=[list(range(-(-n // block_size)))],
    )
    meta = backend.build_metadata(layout, block_size, engine.device)
    ids = torch.tensor(tokens)
    hidden = model(ids, torch.arange(n), meta)  # [n, hidden]
    logprobs = model.compute_logits(hidden).float().log_softmax(-1)  # [n, vocab]
    return logprobs[:-1].gather(1, ids[1:, None])[:, 0]


def bind_cache(engine: Engine, cache: str, inner: AttentionBackend) -> None:
    """Bind every layer of `engine` to a new zero pool of `cache`'s dtype (bf16: `inner`
    itself; FP8: wrapped, with scales 1.0 or to be measured on the next prompt)."""
    kv_cache_dtype, calculate = CACHES[cache]
    layers = engine.kv_cache.layers
    backend = inner
    if kv_cache_dtype != "auto":
        scales = KVScales(len(layers), engine.device, calculate=calculate)
        backend = Fp8KVAttention(inner, KV_CACHE_DTYPES[kv_cache_dtype], scales)
    for index, ((k, _), layer) in enumerate(zip(engine.kv_cache.tensors, layers, strict=True)):
        dtype = backend.kv_cache_dtype or k.dtype
        pool = torch.zeros(k.shape, dtype=dtype), torch.zeros(k.shape, dtype=dtype)
        layer.bind(*pool, backend.for_layer(index))


def quality(args: argparse.Namespace) -> list[str]:
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    chunks = windows(tokenizer, heldout_texts(), 512)[: args.windows]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150_000, (512,), generator=generator).tolist() for _ in range(2)]
    demo = engine_for(str(DEMO_MODEL_DIR), "bf16")
    shape = engine_for(SHAPE, "bf16", load_format="dummy", max_model_len=1024)
    inners = demo.kv_cache.backend, shape.kv_cache.backend
    rows, base, base_logprobs = [], {}, None
    for cache in CACHES:
        bind_cache(demo, cache, inners[0])
        bpb = bits_per_byte(demo, tokenizer, chunks)
        stepped = bits_per_byte(demo, tokenizer, chunks[: args.windows // 4], DECODE_STEP)
        base = base or {"bpb": bpb, "stepped": stepped}
        bind_cache(shape, cache, inners[1])
        logprobs = torch.cat([prompt_logprobs(shape, p) for p in prompts])
        base_logprobs = logprobs if base_logprobs is None else base_logprobs
        delta = (logprobs - base_logprobs).abs()
        rows.append(
            f"| {cache} | {bpb:.4f} | {bpb / base['bpb'] - 1:+.3%} | {stepped:.4f} | "
            f"{stepped / base['stepped'] - 1:+.3%} | {delta.mean():.4f} | {delta.max():.3f} |"
        )
        print(rows[-1], flush=True)
    header = [
        f"Demo model: the first {len(chunks)} held-out windows of 512 tokens "
        f"({args.windows // 4} in 8-token steps). 0.6B shape (random bf16 weights): "
        f"{len(prompts)} prompts of 512 random tokens, {sum(map(len, prompts)) - len(prompts)} "
        "teacher-forced logprobs.",
        "",
        f"| KV cache | demo bits/byte | vs bf16 | in {DECODE_STEP}-token steps | vs bf16 | "
        "0.6B mean abs Δ logprob (nats) | max |",
        "|---|---|---|---|---|---|---|",
    ]
    return header + rows


def concurrent_before_preemption(engine: Engine, prompt_len: int, num_requests: int) -> int:
    """Requests of `prompt_len` tokens (16 new each) running at once before the first
    preemption (or at the peak, if none is preempted)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), [(7 * i + j) % 256 for j in range(prompt_len)], params)
    peak = 0
    while engine.has_unfinished_requests() and engine.scheduler.num_preemptions_total == 0:
        engine.step()
        if engine.scheduler.num_preemptions_total == 0:
            peak = max(peak, len(engine.scheduler.running))
    return peak


def capacity(args: argparse.Namespace) -> list[str]:
    memory = 1 << 30
    tiny = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", max_position_embeddings=4096)
    rows = []
    for cache in ("bf16", "fp8 (e4m3), scales 1.0"):
        shape = engine_for(SHAPE, cache, load_format="dummy", kv_cache_memory=memory)
        tokens = shape.kv_cache.num_blocks * shape.kv_cache.block_size
        del shape
        # 512 bytes a bf16 token (2 layers, 2 KV heads of 32): 3 MiB hold 6,144 tokens.
        engine = engine_for(str(tiny), cache, kv_cache_memory=(3 << 20), max_model_len=4096)
        concurrent = concurrent_before_preemption(engine, 2048, 16)
        rows.append(
            f"| {cache} | {tokens:,} | {concurrent} of 16 "
            f"({engine.kv_cache.num_blocks * engine.kv_cache.block_size:,} tokens) |"
        )
        print(rows[-1], flush=True)
    return [
        "| KV cache | 0.6B shape: tokens in 1 GiB | tiny model, 3 MiB: 2,048-token requests "
        "running at once before the first preemption (pool) |",
        "|---|---|---|",
        *rows,
    ]


def fp8_pool(engine: Engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An FP8 pool shaped like the engine's, of random values."""
    return [
        tuple(torch.randn(k.shape).to(torch.float8_e4m3fn) for _ in range(2))
        for k, _ in engine.kv_cache.tensors
    ]  # type: ignore[misc]


@torch.inference_mode()
def decode_step_s(engine: Engine, context: int, repeats: int) -> float:
    """Median seconds of one decode step (forward + logits) of one request at `context`."""
    backend, block_size = engine.kv_cache.backend, engine.kv_cache.block_size
    table = list(range(-(-context // block_size)))
    layout = StepLayout(
        slot_mapping=[context - 1], query_lens=[1], seq_lens=[context], block_tables=[table]
    )
    ids, positions = torch.tensor([1]), torch.tensor([context - 1])
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        meta = backend.build_metadata(layout, block_size, engine.device)
        engine.model.compute_logits(engine.model(ids, positions, meta))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def speed(args: argparse.Namespace) -> list[str]:
    engine = engine_for(SHAPE, "bf16", load_format="dummy", kv_cache_memory=(960 << 20))
    layers = engine.kv_cache.layers
    bf16_pool = engine.kv_cache.tensors
    for k_cache, v_cache in bf16_pool:
        k_cache.normal_()
        v_cache.normal_()
    inner = engine.kv_cache.backend
    scales = KVScales(len(layers), engine.device)
    fp8 = Fp8KVAttention(inner, KV_CACHE_DTYPES["fp8"], scales)
    bindings = {
        "bf16": [(k, v, inner) for k, v in bf16_pool],
        "fp8": [(k, v, fp8.for_layer(i)) for i, (k, v) in enumerate(fp8_pool(engine))],
    }
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for context in (512, 2048, 8192):
            for cache, binding in bindings.items():
                for layer, (k, v, backend) in zip(layers, binding, strict=True):
                    layer.bind(k, v, backend)
                step_s = decode_step_s(engine, context, args.repeats)
                results.setdefault((cache, context), []).append(step_s)
    rows = []
    for context in (512, 2048, 8192):
        bf16, fp8_s = (statistics.median(results[(c, context)]) for c in bindings)
        rows.append(f"| {context:,} | {1 / bf16:.1f} | {1 / fp8_s:.1f} | {bf16 / fp8_s:.3f} |")
    return [
        f"Median of {args.rounds} rounds, each the median of {args.repeats} steps, "
        f"{torch.get_num_threads()} threads.",
        "",
        "| context | bf16 cache tok/s | fp8 cache tok/s | fp8 / bf16 |",
        "|---|---|---|---|",
        *rows,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["quality", "capacity", "speed"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--windows", type=int, default=80, help="quality: held-out windows")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = {"quality": quality, "capacity": capacity, "speed": speed}
    for name in args.parts:
        started = time.perf_counter()
        lines = parts[name](args)
        print(f"\n## {name} ({time.perf_counter() - started:.0f} s)\n")
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
