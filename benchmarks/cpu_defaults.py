"""In-process CPU measurements behind issue 14's defaults: int8 speed, long prefills, auto dtype.

    python -m benchmarks.cpu_defaults int8        # single-stream decode, int8 against bf16
    python -m benchmarks.cpu_defaults prefill     # one 1,500-token prompt, against a matmul probe
    python -m benchmarks.cpu_defaults auto-dtype  # a small float32 checkpoint: auto (bf16) vs fp32
    python -m benchmarks.cpu_defaults fused       # decode with fused norm/RoPE kernels and without
    python -m benchmarks.cpu_defaults gemv        # the bf16 decode GEMV against oneDNN's product
    python -m benchmarks.cpu_defaults gemv-layout  # decode steps: the GEMV's layout vs plain
    python -m benchmarks.cpu_defaults int8-layout  # the same in int8: blocks vs row pairs
    python -m benchmarks.cpu_defaults attention   # decode attention: our kernel against eager
    python -m benchmarks.cpu_defaults prompt-attention  # prompt chunks: our kernel against SDPA
    python -m benchmarks.cpu_defaults bf16-methods  # the CPU's bf16 linears vs float32, F.linear

Arms that are compared run in one process, alternating round by round, so that a noisy machine
shifts both; medians are printed. Random (dummy or seeded) weights, greedy decoding.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.bench.machine import measure_read_bandwidth_gb_s
from nanoserve.core.attention.reference import chunk_attention, decode_group_attention
from nanoserve.core.layers.ops import PORTABLE_OPS, install_layer_ops
from nanoserve.platforms.cpu import linear as cpu_linear
from nanoserve.platforms.cpu.fused_ops import FusedCpuOps
from nanoserve.platforms.cpu.kernels import load_cpu_kernels
from nanoserve.platforms.cpu.linear import (
    PackedLinearMethod,
    decode_gemv,
    decode_gemv_layout,
    pack,
    packed_linear,
    packing_works,
)
from tests.tiny_checkpoints import make_tiny_checkpoint

QWEN3_06B = "Qwen/Qwen3-0.6B"
# Qwen3-0.6B: per layer q/k/v (1024 -> 4096), o (2048 -> 1024), gate/up/down (1024 <-> 3072).
LINEAR_PARAMS_06B = 28 * (1024 * 4096 + 2048 * 1024 + 3 * 1024 * 3072)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def decode_tok_s(llm: LLM, prompt: list[int], num_tokens: int) -> float:
    """Tokens per second of decoding alone: a full request minus a one-token prefill (of
    another first token, so that neither run finds the other's blocks in the prefix cache)."""
    started = time.perf_counter()
    llm.generate([[prompt[0] + 1, *prompt[1:]]], SamplingParams(temperature=0, max_tokens=1))
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=num_tokens + 1, ignore_eos=True)
    llm.generate([prompt], params)
    return num_tokens / (time.perf_counter() - started - prefill_s)


Switch = Callable[[], object]  # sets an arm up on a shared model (the result is ignored)


def alternate(
    llms: dict[str, LLM],
    rounds: int,
    num_tokens: int,
    switches: Mapping[str, Switch] | None = None,
    context: int = 46,
) -> dict[str, list[float]]:
    """Each round decodes one new prompt (`context` + 1 tokens) per arm, arms in turn; an
    arm's switch, if given, runs first (arms sharing one model switch a path on and off)."""
    results: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(rounds):
        for name, llm in llms.items():
            if switches is not None:
                switches[name]()
            prompt = [r * 7 + 3, *range(100, 100 + context)]
            results[name].append(decode_tok_s(llm, prompt, num_tokens))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} tok/s" for k, v in results.items()))
    return results


def measure_int8(rounds: int) -> None:
    llms = {
        "bf16": LLM(QWEN3_06B, load_format="dummy", max_model_len=1024),
        "int8": LLM(QWEN3_06B, load_format="dummy", max_model_len=1024, quantization="int8"),
    }
    results = alternate(llms, rounds, num_tokens=32)
    bf16, int8 = median(results["bf16"]), median(results["int8"])
    bandwidth, _ = measure_read_bandwidth_gb_s(torch.get_num_threads())
    print(
        f"median decode: bf16 {bf16:.2f}, int8 {int8:.2f} tok/s -> int8 {int8 / bf16:.2f}x; "
        f"read bandwidth {bandwidth:.1f} GB/s"
    )


def matmul_probe_tflops(rows: int) -> float:
    """The packed bf16 product of `rows` tokens by a 1024 -> 6144 weight: this CPU's peak
    (float32 `F.linear` where oneDNN cannot pack bf16: the widened products' peak)."""
    if packing_works():
        x = torch.randn(rows, 1024, dtype=torch.bfloat16)  # [rows, 1024]
        packed = pack(torch.randn(6144, 1024, dtype=torch.bfloat16))  # [6144, 1024]
        product = lambda: packed_linear(x, packed, None)  # noqa: E731
    else:
        x, weight = torch.randn(rows, 1024), torch.randn(6144, 1024)
        product = lambda: torch.nn.functional.linear(x, weight)  # noqa: E731
    product()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        product()
        times.append(time.perf_counter() - started)
    return 2 * rows * 1024 * 6144 / min(times) / 1e12


def measure_prefill(num_tokens: int, runs: int) -> None:
    peak = matmul_probe_tflops(num_tokens)
    llm = LLM(QWEN3_06B, load_format="dummy", max_model_len=4096, dtype="bfloat16")
    one_token = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([list(range(200, 300))], one_token)
    times = []
    for i in range(runs):
        started = time.perf_counter()
        llm.generate([[1000 + i, *range(2000, 2000 + num_tokens - 1)]], one_token)
        times.append(time.perf_counter() - started)
    attention = 28 * 2 * 2 * num_tokens * num_tokens / 2 * 16 * 128  # causal QK^T and PV
    flops = 2 * LINEAR_PARAMS_06B * num_tokens + attention
    best = min(times)
    print(
        f"{num_tokens}-token prefill: best {best:.2f} s of {[round(t, 2) for t in times]}, "
        f"{flops / 1e12:.2f} TFLOP -> {flops / best / 1e12:.3f} TFLOP/s; matmul probe "
        f"{peak:.3f} TFLOP/s ({flops / best / 1e12 / peak:.0%} of it)"
    )


def measure_auto_dtype(rounds: int) -> None:
    checkpoint = make_tiny_checkpoint(
        tempfile.mkdtemp(),
        "qwen3",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
    )
    llms = {
        "auto": LLM(str(checkpoint), max_model_len=1024),
        "float32": LLM(str(checkpoint), max_model_len=1024, dtype="float32"),
    }
    results = alternate(llms, rounds, num_tokens=64)
    auto, fp32 = median(results["auto"]), median(results["float32"])
    print(f"median decode: auto (bf16) {auto:.0f}, float32 {fp32:.0f} tok/s -> {auto / fp32:.2f}x")


def prefill_s(llm: LLM, num_tokens: int, first: int) -> float:
    """Seconds of one cold `num_tokens` prompt and its one token (`first` keeps it uncached)."""
    started = time.perf_counter()
    prompt = [first, *range(2000, 2000 + num_tokens - 1)]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - started


def measure_bf16_methods(rounds: int, prompt_tokens: int) -> None:
    """The 0.6B shape three ways, alternating: bf16 with the CPU's linear method (packed, or
    widened where oneDNN cannot pack), float32 weights, and bf16 through plain `F.linear`."""
    dense = LLM(QWEN3_06B, load_format="dummy", max_model_len=4096, dtype="bfloat16")
    llms = {"bf16 (default)": dense}
    llms["float32"] = LLM(QWEN3_06B, load_format="dummy", max_model_len=4096, dtype="float32")
    is_bf16_cpu = cpu_linear.is_bf16_cpu
    cpu_linear.is_bf16_cpu = lambda weight: False  # type: ignore[assignment]  # no CPU method
    try:
        llms["bf16 F.linear"] = LLM(QWEN3_06B, load_format="dummy", max_model_len=4096)
    finally:
        cpu_linear.is_bf16_cpu = is_bf16_cpu  # type: ignore[assignment]
    decode = alternate(llms, rounds, num_tokens=32)
    prefills: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(max(1, rounds // 2)):
        for name, llm in llms.items():
            prefills[name].append(prefill_s(llm, prompt_tokens, 1000 + r))
        print(
            f"prefill round {r + 1}: "
            + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in prefills.items())
        )
    bandwidth, _ = measure_read_bandwidth_gb_s(torch.get_num_threads())
    print(f"packing works here: {packing_works()}; read bandwidth {bandwidth:.1f} GB/s")
    for name in llms:
        print(
            f"{name}: decode {median(decode[name]):.2f} tok/s, "
            f"{prompt_tokens}-token prefill {median(prefills[name]):.2f} s"
        )


def measure_fused(rounds: int, prompt_tokens: int = 71) -> None:
    """One model, the fused CPU kernels switched on and off round by round: decode, then a
    71-token prefill (a fresh prompt each time)."""
    llm = LLM(QWEN3_06B, load_format="dummy", max_model_len=1024)
    model, fused_ops = llm.engine.model, FusedCpuOps(load_cpu_kernels())
    switches = {
        "plain ops": lambda: install_layer_ops(model, PORTABLE_OPS),
        "fused": lambda: install_layer_ops(model, fused_ops),
    }
    results = alternate(dict.fromkeys(switches, llm), rounds, 32, switches)
    plain, fused = median(results["plain ops"]), median(results["fused"])
    print(f"median decode: plain {plain:.2f}, fused {fused:.2f} tok/s -> {fused / plain:.3f}x")
    prefill_ms: dict[str, list[float]] = {name: [] for name in switches}
    for r in range(rounds):
        for name, switch in switches.items():
            switch()
            prompt = [5000 + r * 2 + len(name), *range(200, 200 + prompt_tokens - 1)]
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
            prefill_ms[name].append((time.perf_counter() - started) * 1e3)
    plain, fused = median(prefill_ms["plain ops"]), median(prefill_ms["fused"])
    print(f"median {prompt_tokens}-token prefill: plain {plain:.1f}, fused {fused:.1f} ms")


def linear_pass_s(
    product, inputs: dict[int, torch.Tensor], weights: list, in_features: list[int]
) -> float:
    """Seconds for one pass of `product` over every weight (the fastest of three)."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        for weight, k in zip(weights, in_features, strict=True):
            product(inputs[k], weight)
        times.append(time.perf_counter() - started)
    return min(times)


def measure_gemv_products() -> None:
    """1-8 tokens times the 0.6B shape's layer weights: oneDNN (packed), the GEMV on the plain
    weight, and the GEMV on its own layout (`bf16_gemv_weight`: blocks on AVX-512 BF16)."""
    gemv, layout = decode_gemv(), decode_gemv_layout()
    assert gemv is not None and layout is not None, "the bf16 GEMV is not built for this CPU"
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # [out, in] per layer
    plain = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(28) for shape in shapes]
    packed = [pack(weight) for weight in plain]
    laid_out = [layout(weight) for weight in plain]
    in_features = [weight.shape[1] for weight in plain]
    gigabytes = 2 * LINEAR_PARAMS_06B / 1e9
    for rows in range(1, 9):
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (1024, 2048, 3072)}
        product = lambda x, w: packed_linear(x, w, None)  # noqa: E731
        onednn = linear_pass_s(product, inputs, packed, in_features)
        on_plain = linear_pass_s(gemv, inputs, plain, in_features)
        ours = linear_pass_s(gemv, inputs, laid_out, in_features)
        print(
            f"{rows} rows: oneDNN packed {gigabytes / onednn:.1f} GB/s, GEMV plain "
            f"{gigabytes / on_plain:.1f}, GEMV laid out {gigabytes / ours:.1f} GB/s -> "
            f"{onednn / ours:.2f}x oneDNN, {on_plain / ours:.2f}x plain"
        )


@contextlib.contextmanager
def gemv_blocks_off(quantization: str | None) -> Iterator[None]:
    """Models loaded inside read their decode GEMV's weights as before the block layout: the
    bf16 GEMV the plain weight, the int8 GEMV row pairs."""
    if quantization == "int8":
        kernels = load_cpu_kernels()
        assert kernels is not None, "the CPU kernels did not build"
        blocks = kernels.int8_gemv_blocks
        kernels.int8_gemv_blocks = lambda weight: None
        try:
            yield
        finally:
            kernels.int8_gemv_blocks = blocks
        return
    layout = cpu_linear.decode_gemv_layout
    cpu_linear.decode_gemv_layout = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_linear.decode_gemv_layout = layout  # type: ignore[assignment]


def measure_gemv_layout(rounds: int, quantization: str | None = None) -> None:
    """Decode steps of the 0.6B shape (bf16, or `quantization`), 1, 4 and 8 requests: one model
    whose GEMVs read their weights as before the block layout (`gemv_blocks_off`) and one in
    blocks, round by round."""
    from benchmarks.decode_steps import median_step_ms

    with gemv_blocks_off(quantization):
        before = LLM(QWEN3_06B, load_format="dummy", max_model_len=1024, quantization=quantization)
    blocks = LLM(QWEN3_06B, load_format="dummy", max_model_len=1024, quantization=quantization)
    for llm in (before, blocks):  # the KV pools resident, as the server's worker makes them
        while llm.engine.idle_work():
            pass
    names = ("row pairs" if quantization == "int8" else "plain", "blocks")
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for batch in (1, 4, 8):
            for name, llm in zip(names, (before, blocks), strict=True):
                ms = median_step_ms(llm, batch, f"{name}-{r}-{batch}", steps=22)
                results.setdefault((name, batch), []).append(ms)
        print(f"round {r + 1}: " + ", ".join(f"{k}: {v[-1]:.1f} ms" for k, v in results.items()))
    for batch in (1, 4, 8):
        a, b = (median(results[name, batch]) for name in names)
        print(
            f"{batch} requests, median step: {names[0]} {a:.1f}, blocks {b:.1f} ms ({a / b:.2f}x)"
        )


def measure_gemv(rounds: int) -> None:
    """The products, then one model decoding with the GEMV and without, round by round."""
    measure_gemv_products()
    llm = LLM(QWEN3_06B, load_format="dummy", max_model_len=1024)
    method = next(
        m.method
        for m in llm.engine.model.modules()
        if isinstance(getattr(m, "method", None), PackedLinearMethod)
    )
    gemv = method.gemv
    switches = {
        "packed": lambda: setattr(method, "gemv", None),
        "gemv": lambda: setattr(method, "gemv", gemv),
    }
    results = alternate(dict.fromkeys(switches, llm), rounds, 32, switches)
    packed, ours = median(results["packed"]), median(results["gemv"])
    bandwidth, _ = measure_read_bandwidth_gb_s(torch.get_num_threads())
    print(
        f"median decode: packed {packed:.2f}, gemv {ours:.2f} tok/s -> {ours / packed:.3f}x; "
        f"read bandwidth {bandwidth:.1f} GB/s"
    )


def measure_decode_attention(rounds: int) -> None:
    """One model, decode attention by our kernel and by the eager path, round by round, after
    a short and a long prompt."""
    llm = LLM(QWEN3_06B, load_format="dummy", max_model_len=2048)
    backend = llm.engine.kv_cache.backend
    kernel = backend.attend_decodes
    switches = {
        "eager": lambda: setattr(backend, "attend_decodes", decode_group_attention),
        "kernel": lambda: setattr(backend, "attend_decodes", kernel),
    }
    for context in (46, 1000):
        results = alternate(dict.fromkeys(switches, llm), rounds, 32, switches, context)
        eager, ours = median(results["eager"]), median(results["kernel"])
        print(
            f"{context + 1}-token prompt, median decode: eager {eager:.2f}, kernel "
            f"{ours:.2f} tok/s -> {ours / eager:.2f}x (rounds: {results})"
        )


def chunk_attention_ms(attend: Callable[..., torch.Tensor], num_tokens: int) -> float:
    """Best of 5 of one layer's attention over a cold `num_tokens` prompt (0.6B shape)."""
    query = torch.randn(num_tokens, 16, 128, dtype=torch.bfloat16)
    key, value = (torch.randn(num_tokens, 8, 128, dtype=torch.bfloat16) for _ in "kv")
    attend(query, key, value, None, 128**-0.5)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        attend(query, key, value, None, 128**-0.5)
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def measure_prompt_attention(rounds: int, num_tokens: int) -> None:
    """One model, prompt chunks through our prompt kernel (AMX tiles or AVX-512 BF16) and
    through SDPA, round by round: one layer's attention alone, then a whole cold prefill."""
    llm = LLM(QWEN3_06B, load_format="dummy", max_model_len=max(4096, num_tokens + 1))
    backend = llm.engine.kv_cache.backend
    if not getattr(backend, "prompt_kernel", False):
        print("no prompt kernel here (no AVX-512 BF16, or the kernels did not build)")
        return
    kernel, sdpa = backend.attend_chunk, chunk_attention
    layer: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    prefill: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    prefill_s(llm, num_tokens, first=1)
    for r in range(rounds):
        for index, (name, attend) in enumerate((("kernel", kernel), ("sdpa", sdpa))):
            backend.prompt_kernel = name == "kernel"  # the backend's own choice, for both timings
            layer[name].append(chunk_attention_ms(attend, num_tokens))
            first = 10 + 2 * r + index  # a prompt of its own each time: nothing cached
            prefill[name].append(prefill_s(llm, num_tokens, first=first) * 1e3)
        print(
            f"round {r + 1}: "
            + ", ".join(
                f"{k} layer {layer[k][-1]:.2f} ms, prefill {prefill[k][-1]:.0f} ms" for k in layer
            )
        )
    ours, ref = median(layer["kernel"]), median(layer["sdpa"])
    ours_prefill, ref_prefill = median(prefill["kernel"]), median(prefill["sdpa"])
    print(
        f"{num_tokens}-token prompt, medians: one layer's attention kernel {ours:.2f} / sdpa "
        f"{ref:.2f} ms ({ref / ours:.2f}x); cold prefill kernel {ours_prefill:.0f} / sdpa "
        f"{ref_prefill:.0f} ms ({ref_prefill / ours_prefill:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    measures = ["int8", "prefill", "auto-dtype", "fused", "gemv", "attention", "bf16-methods"]
    measures += ["prompt-attention", "gemv-layout", "int8-layout"]
    parser.add_argument("measure", choices=measures)
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default: 4)")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="prefill (default: 1500)")
    args = parser.parse_args()
    print(f"{torch.get_num_threads()} threads")
    if args.measure == "int8":
        measure_int8(args.rounds)
    elif args.measure == "prefill":
        measure_prefill(args.prompt_tokens, runs=3)
    elif args.measure == "fused":
        measure_fused(args.rounds)
    elif args.measure == "gemv":
        measure_gemv(args.rounds)
    elif args.measure == "gemv-layout":
        measure_gemv_layout(args.rounds)
    elif args.measure == "int8-layout":
        measure_gemv_layout(args.rounds, quantization="int8")
    elif args.measure == "attention":
        measure_decode_attention(args.rounds)
    elif args.measure == "prompt-attention":
        measure_prompt_attention(args.rounds, args.prompt_tokens)
    elif args.measure == "bf16-methods":
        measure_bf16_methods(args.rounds, args.prompt_tokens)
    else:
        measure_auto_dtype(args.rounds)


if __name__ == "__main__":
    main()
