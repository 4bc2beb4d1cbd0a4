"""Write a Qwen3-30B-A3B-shaped checkpoint with fewer layers, seeded weights, for the peers.

`benchmarks/moe_decode.py` measures nanoserve in-process on `--load-format dummy` weights; the
peers (llama.cpp's server, vLLM) need files. This writes the `Qwen/Qwen3-30B-A3B` preset's
config with `num_hidden_layers` cut to `--layers` as a safetensors checkpoint through
transformers (its own layout, which every peer reads), with the benchmark models' seeded weights
and byte tokenizer, so `nanoserve bench --model DIR` serves it to every arm:

    python -m benchmarks.moe_checkpoint --layers 2 --out DIR
    nanoserve bench --model DIR --workload scoreboard --arm nanoserve --arm llamacpp \\
        --arm vllm-compiled
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from nanoserve.bench.models import EOS_TOKEN_ID, PAD_TOKEN_ID, init_seeded_weights
from nanoserve.common.checkpoint import make_dummy_model_dir
from nanoserve.text.byte_tokenizer import save_byte_level_tokenizer

PRESET = "Qwen/Qwen3-30B-A3B"


def write_checkpoint(layers: int, out: Path, seed: int = 0) -> Path:
    """The preset's shape with `layers` layers, bf16, seeded; reused when `out` has it."""
    import transformers

    stamp = {"preset": PRESET, "layers": layers, "seed": seed, "format": 1}
    stamp_path = out / "bench_model.json"
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        return out
    config = transformers.AutoConfig.from_pretrained(make_dummy_model_dir(PRESET))
    config.num_hidden_layers = layers
    config.max_position_embeddings = 4096
    config.vocab_size = 151936
    started = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    init_seeded_weights(model, seed)
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    save_byte_level_tokenizer(out, model_max_length=config.max_position_embeddings)
    stamp_path.write_text(json.dumps(stamp))
    print(f"wrote {out} ({layers} layers) in {time.perf_counter() - started:.1f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_checkpoint(args.layers, args.out.expanduser(), args.seed)


if __name__ == "__main__":
    main()
