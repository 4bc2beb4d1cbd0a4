"""What quantization costs in quality: held-out bits per byte and greedy agreement with bf16.

    python -m benchmarks.quantization_quality            # the demo model, CPU

For each variant of the demo model (bf16; int8; int8 with a bf16 LM head; an FP8 checkpoint
written from the bf16 one, the "FP8 round trip") it measures, with nanoserve's own model code:
the held-out bits per byte of the demo model's training script (every 25th standard-library file
by sorted path, teacher-forced over windows of --window tokens, once in one pass per window and
once 8 tokens at a time, as decode steps multiply on CPU), and, for 4 everyday Python
openings, how many of --greedy-tokens greedy tokens equal bf16's (position by position) and where
the first difference falls.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from nanoserve.common.checkpoint import DEMO_MODEL_DIR
from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.engine import Engine
from nanoserve.core.step_layout import StepLayout
from nanoserve.engine_setup import build_engine
from nanoserve.text.tokenizer import load_tokenizer
from tests.tiny_checkpoints import make_fp8_checkpoint

PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:", "for i in range(")
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_demo_model.py"
HOLDOUT_EVERY = 25  # the training script's default split
DECODE_STEP = 8  # tokens per forward in the stepped measurement (the decode GEMVs' largest)


def heldout_texts() -> list[str]:
    """The demo model's held-out files, by the training script's own rule."""
    spec = importlib.util.spec_from_file_location("train_demo_model", TRAIN_SCRIPT)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    corpus = train.collect_corpus(Path(sysconfig.get_paths()["stdlib"]))
    return [text for i, (_, text) in enumerate(corpus) if i % HOLDOUT_EVERY == 0]


def windows(tokenizer, texts: list[str], size: int) -> list[list[int]]:
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    stream: list[int] = []
    for text in texts:
        stream += tokenizer.encode(text, add_special_tokens=False) + [eot]
    return [stream[i : i + size] for i in range(0, len(stream) - 1, size) if i + 2 <= len(stream)]


@torch.inference_mode()
def window_nats(engine: Engine, tokens: list[int], step: int | None = None) -> float:
    """Teacher-forced negative log-likelihood of tokens[1:] given their prefixes, in nats: in
    one pass, or `step` tokens at a time over the KV cache, as decode steps run (on CPU, int8
    linears multiply 8 tokens or fewer with the decode GEMV, not the prefill's matmul)."""
    model, backend, device = engine.model, engine.kv_cache.backend, engine.device
    n, block_size = len(tokens), engine.kv_cache.block_size
    ids = torch.tensor(tokens, device=device)
    table = list(range(-(-n // block_size)))  # blocks 0.. of the idle engine's cache
    logprobs = []
    for start in range(0, n, step or n):
        end = min(n, start + (step or n))
        layout = StepLayout(
            query_lens=[end - start],
            seq_lens=[end],
            block_tables=[table[: -(-end // block_size)]],
            slot_mapping=list(range(start, end)),
        )
        meta = backend.build_metadata(layout, block_size, device)
        positions = torch.arange(start, end, device=device)
        hidden = model(ids[start:end], positions, meta)  # [end - start, hidden]
        logprobs.append(model.compute_logits(hidden).log_softmax(-1))
    return -torch.cat(logprobs)[:-1].gather(1, ids[1:, None]).sum().item()  # [n - 1] picked


def bits_per_byte(
    engine: Engine, tokenizer, chunks: list[list[int]], step: int | None = None
) -> float:
    byte_lengths: dict[int, int] = {}
    total_nats, total_bytes = 0.0, 0
    for tokens in chunks:
        total_nats += window_nats(engine, tokens, step)
        for token in tokens[1:]:
            if token not in byte_lengths:
                byte_lengths[token] = len(tokenizer.decode([token]).encode())
            total_bytes += byte_lengths[token]
    return total_nats / math.log(2) / total_bytes


def greedy(engine: Engine, tokenizer, num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), tokenizer.encode(prompt), params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return [outputs[str(i)] for i in range(len(PROMPTS))]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, int]:
    """Share of positions equal to the reference, and the earliest first difference."""
    same = sum(
        a == b for x, y in zip(ours, reference, strict=True) for a, b in zip(x, y, strict=True)
    )
    total = sum(len(y) for y in reference)
    first = min(
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(y))
        for x, y in zip(ours, reference, strict=True)
    )
    return same / total, first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--greedy-tokens", type=int, default=500)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/quantization"))
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    chunks = windows(tokenizer, heldout_texts(), args.window)
    fp8_dir = make_fp8_checkpoint(args.model, Path(tempfile.mkdtemp()) / "fp8")
    variants = {
        "bf16": {"model": str(args.model)},
        "int8": {"model": str(args.model), "quantization": "int8"},
        "int8, bf16 LM head": {
            "model": str(args.model),
            "quantization": "int8",
            "quantize_lm_head": False,
        },
        "FP8 round trip": {"model": str(fp8_dir)},
    }
    rows, reference = [], None
    for name, settings in variants.items():
        started = time.perf_counter()
        engine = build_engine(EngineConfig(dtype="bfloat16", device="cpu", **settings))
        bpb = bits_per_byte(engine, tokenizer, chunks)
        tokens = greedy(engine, tokenizer, args.greedy_tokens)
        reference = reference or tokens
        share, first = agreement(tokens, reference)
        stepped = bits_per_byte(engine, tokenizer, chunks, DECODE_STEP)
        rows.append(
            {
                "variant": name,
                "bpb": bpb,
                "bpb_decode_steps": stepped,
                "greedy_agreement": share,
                "first_diff": first,
                "seconds": time.perf_counter() - started,
            }
        )
        print(
            f"{name}: {bpb:.4f} bits/byte ({stepped:.4f} in {DECODE_STEP}-token steps), "
            f"greedy {share:.1%} (first difference at {first})"
        )
    base = rows[0]["bpb"]
    print(
        f"\n{len(chunks)} windows of {args.window} tokens; {args.greedy_tokens} greedy tokens "
        f"x {len(PROMPTS)} prompts\n"
    )
    stepped_base = rows[0]["bpb_decode_steps"]
    print(
        f"| variant | held-out bits/byte | vs bf16 | in {DECODE_STEP}-token steps | vs bf16 "
        "| greedy tokens equal to bf16 | first diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['bpb']:.4f} | {row['bpb'] / base - 1:+.2%} | "
            f"{row['bpb_decode_steps']:.4f} | {row['bpb_decode_steps'] / stepped_base - 1:+.2%} "
            f"| {row['greedy_agreement']:.1%} | {row['first_diff']} |"
        )
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "quantization_quality.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
