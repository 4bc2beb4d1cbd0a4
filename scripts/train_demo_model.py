#!/usr/bin/env python
"""Train the tiny demo model shipped in ``nanoserve/assets/demo``.

The demo model is a toy: a ~4M-parameter Qwen3-architecture causal LM that completes Python
code. It exists so that ``nanoserve serve`` works out of the box (no downloads) and so that the
test suite has a real, non-random checkpoint to exercise. It is *not* a chat assistant.

Everything is derived from the standard library source of the running interpreter
(``Lib/**/*.py``), so the corpus needs no download and its license (PSF) is clear:

1. Collect a sorted, filtered list of stdlib ``.py`` files; hold out every ``--holdout-every``-th
   file (by sorted path) for evaluation.
2. Train a byte-level BPE tokenizer (``tokenizers``) on the training files, with ChatML and
   fill-in-the-middle special tokens.
3. Train ``Qwen3ForCausalLM`` with a plain PyTorch loop (AdamW, warmup + cosine LR, bf16
   autocast on CPU) on fixed-length windows sampled by a seeded RNG. A small fraction of the
   windows are rewritten into FIM (prefix/suffix/middle) and ChatML form, so the special tokens
   are not untrained and chat/FIM requests terminate instead of rambling until max_tokens.
   With ``--unlikelihood W``, each step also lets the model continue training prefixes
   greedily and makes the tokens that loop less likely (``demo_loops.py``).
4. Evaluate held-out loss and bits per byte, save a normal Hugging Face checkpoint (bf16
   safetensors + tokenizer + chat template + generation config) and write a model card.

Reproducibility: a fixed seed drives model init and data sampling, and the step count is fixed
(not time-based). Bit-identical weights additionally need the same Python stdlib (3.11.7 for
the shipped checkpoint), torch version and thread count.

Usage (the shipped checkpoint's card gives the commands of its three runs)::

    python scripts/train_demo_model.py
    python scripts/train_demo_model.py --init-from nanoserve/assets/demo --unlikelihood 2 \\
        --lr 4e-4 --warmup 20 --time-budget-min 45 --out /tmp/demo-new
    python scripts/train_demo_model.py --steps 50 --out /tmp/demo-smoke   # quick smoke run
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import time
import tokenize
from pathlib import Path

# Let idle OpenMP workers sleep instead of spinning: on a small, shared CPU machine (2 cores
# here, with other processes running) spinning threads slow training down several-fold.
# Must be set before torch (and its OpenMP runtime) is loaded; does not change the numerics.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for demo_loops beside this script
import demo_loops  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "nanoserve" / "assets" / "demo"

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_SUFFIX = "<|fim_suffix|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX]

# Directory names (anywhere in the relative path) left out of the corpus: the test suites and
# IDLE are huge and repetitive, encodings/ is mostly generated codec tables, pydoc_data is one
# 750 kB string literal, lib2to3/turtledemo are legacy/demo code.
EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "encodings",
        "lib2to3",
        "turtledemo",
        "pydoc_data",
    }
)

# Qwen-style ChatML. Content may be a string, None, or a list of OpenAI-style parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set content = message['content'] -%}"
    "{%- elif message['content'] is none -%}"
    "{%- set content = '' -%}"
    "{%- else -%}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

SAMPLE_PROMPT = "def fibonacci(n):"
SAMPLE_TOKENS = 48
# Greedy completions of the judged openings (demo_loops.py) are this long, as the tests'.
OPENING_TOKENS = 64


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------


def collect_corpus(stdlib: Path) -> list[tuple[str, str]]:
    """Return sorted ``(relative_posix_path, text)`` pairs of the stdlib's Python files."""
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        files.append(rel.as_posix())
    files.sort()
    corpus = []
    for rel in files:
        text = (stdlib / rel).read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            corpus.append((rel, text))
    return corpus


def docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers (1-based) of every module, class and function docstring that can go
    without leaving an empty body."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        is_doc = (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        )
        if first is None or not is_doc or len(node.body) < 2:
            continue
        if not isinstance(node, ast.Module) and first.lineno == node.lineno:
            continue  # `def f(): "doc"; ...` on one line
        lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def strip_prose(text: str) -> str:
    """`text` without its docstrings and comments, and at most two blank lines in a row: the
    code alone (a file that does not parse is returned unchanged).

    Small models trained on the stdlib learn its English prose as readily as its code, and at
    temperature 0 prose is where they loop ("the number of the number of ..."); a code-only
    corpus keeps greedy completions in code.
    """
    try:
        tree = ast.parse(text)
        comments = [
            tok.start
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT
        ]
    except (SyntaxError, ValueError, tokenize.TokenError):
        return text
    lines = text.splitlines()
    for row, col in comments:
        lines[row - 1] = lines[row - 1][:col].rstrip() or "\0"  # "\0": a line to drop
    for row in docstring_lines(tree):
        lines[row - 1] = "\0"
    kept: list[str] = []
    for line in lines:
        blank_run = len(kept) >= 2 and not kept[-1].strip() and not kept[-2].strip()
        if line == "\0" or (not line.strip() and blank_run):
            continue
        kept.append(line)
    return "\n".join(kept).strip("\n") + "\n"


def corpus_digest(corpus: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for rel, text in corpus:
        h.update(rel.encode())
        h.update(b"\0")
        h.update(text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out: Path, model_max_length: int) -> None:
    """Write tokenizer.json + a tokenizer_config.json loadable by transformers 4.x and 5.x."""
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


class WindowSampler:
    """Seeded sampler of ``seq_len + 1`` token rows from one concatenated token stream.

    Rows are plain windows, or (with small probabilities) the same kind of window rewritten as
    fill-in-the-middle (PSM order) or as a run of short ChatML exchanges whose user turn is a
    code fragment and whose assistant turn is its continuation.
    """

    def __init__(
        self,
        stream: torch.Tensor,
        seq_len: int,
        seed: int,
        ids: dict[str, list[int]],
        fim_rate: float,
        chat_rate: float,
    ) -> None:
        self.stream = stream
        self.row = seq_len + 1
        self.rng = random.Random(seed)
        self.ids = ids
        self.fim_rate = fim_rate
        self.chat_rate = chat_rate

    def _span(self, n: int) -> list[int]:
        start = self.rng.randrange(len(self.stream) - n)
        return self.stream[start : start + n].tolist()

    def _fim(self) -> list[int]:
        ids = self.ids
        span = self._span(self.row - 4)
        i, j = sorted(self.rng.randint(0, len(span)) for _ in range(2))
        prefix, middle, suffix = span[:i], span[i:j], span[j:]
        return (
            ids["fim_prefix"]
            + prefix
            + ids["fim_suffix"]
            + suffix
            + ids["fim_middle"]
            + middle
            + ids["eot"]
        )

    def _chat(self) -> list[int]:
        ids = self.ids
        row: list[int] = []
        while len(row) < self.row:
            n_user = self.rng.randint(8, 160)
            n_asst = self.rng.randint(4, 96)
            span = self._span(n_user + n_asst)
            row += (
                ids["user"]
                + span[:n_user]
                + ids["end_user"]
                + span[n_user:]
                + ids["end_asst"]
                + ids["eot"]
            )
        return row[: self.row]

    def batch(self, batch_size: int) -> torch.Tensor:
        rows = []
        for _ in range(batch_size):
            r = self.rng.random()
            if r < self.fim_rate:
                rows.append(self._fim())
            elif r < self.fim_rate + self.chat_rate:
                rows.append(self._chat())
            else:
                rows.append(self._span(self.row))
        return torch.tensor(rows, dtype=torch.long)


def loop_step(model, rollouts, args: argparse.Namespace, eos: list[int], bf16: bool) -> float:
    """Add the unlikelihood gradient of one batch of greedy rollouts to the model's gradients
    (the caller has already back-propagated the ordinary loss). Returns the share of the
    generated tokens that were marked as loops."""
    prefixes = rollouts.batch(args.rollout_batch)  # [B, n]
    tokens = demo_loops.greedy_rollouts(model, prefixes, args.rollout_tokens, eos)  # [B, n + L]
    marked = demo_loops.loop_mask(tokens, start=prefixes.shape[1])
    generated = args.rollout_batch * args.rollout_tokens
    if not marked.any():
        return 0.0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=tokens).logits  # [B, n + L, V]
    loss, hits = demo_loops.unlikelihood_loss(logits, tokens, marked, generated)
    (args.unlikelihood * loss).backward()
    return hits / generated


def encode_docs(tok, texts: list[str]) -> list[list[int]]:
    return [enc.ids for enc in tok.encode_batch(texts)]


def join_docs(docs: list[list[int]], eot_id: int) -> torch.Tensor:
    """One token stream: each document followed by ``<|endoftext|>``."""
    return torch.tensor([t for doc in docs for t in (*doc, eot_id)], dtype=torch.long)


# --------------------------------------------------------------------------------------------
# model / eval
# --------------------------------------------------------------------------------------------


def build_config(args: argparse.Namespace, vocab_size: int, eot_id: int, im_end_id: int):
    from transformers import Qwen3Config

    kwargs = {
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_positions,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": [eot_id, im_end_id],
        "pad_token_id": eot_id,
    }
    try:  # transformers >= 5
        return Qwen3Config(
            **kwargs, rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta}
        )
    except TypeError:  # transformers 4.x
        return Qwen3Config(**kwargs, rope_theta=args.rope_theta)


def add_legacy_config_keys(path: Path, rope_theta: float) -> None:
    """Also write the pre-5.x spellings (``rope_theta``, ``torch_dtype``) into config.json.

    transformers 5 stores ``rope_parameters``/``dtype``; most published Qwen3 configs (and
    transformers 4.x) use the flat keys. Both loaders accept the union, so readers of either
    generation find what they expect.
    """
    config = json.loads(path.read_text())
    config.setdefault("rope_theta", rope_theta)
    config.setdefault("torch_dtype", config.get("dtype", "bfloat16"))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def lr_at(step: int, args: argparse.Namespace, time_fraction: float | None = None) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio × lr over the steps, or over the time
    budget when one is given (`time_fraction`: the share of it used so far)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    if time_fraction is not None:
        progress = min(1.0, time_fraction)
    min_lr = args.lr * args.min_lr_ratio
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(
    model,
    stream: torch.Tensor,
    byte_len: torch.Tensor,
    seq_len: int,
    eot_id: int,
    max_windows: int | None = None,
    autocast: bool = False,
) -> dict[str, float]:
    """Mean loss (nats/token) and bits per byte over non-overlapping windows.

    Every token except the first of each window is predicted; ``<|endoftext|>`` targets
    (document separators) are excluded from both loss and byte count.
    """
    model.eval()
    total_nats, total_tokens, total_bytes = 0.0, 0, 0
    n_windows = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    eval_batch = 8
    for w0 in range(0, n_windows, eval_batch):
        starts = range(w0 * seq_len, min(n_windows, w0 + eval_batch) * seq_len, seq_len)
        x = torch.stack([stream[s : s + seq_len] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x).logits.float()
        targets = x[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
        ).view_as(targets)
        mask = targets != eot_id
        total_nats += nll[mask].sum().item()
        total_tokens += int(mask.sum())
        total_bytes += int(byte_len[targets][mask].sum())
    model.train()
    loss = total_nats / max(1, total_tokens)
    bpb = total_nats / math.log(2) / max(1, total_bytes)
    return {"loss": loss, "bpb": bpb, "tokens": total_tokens, "bytes": total_bytes}


def token_byte_lengths(tok) -> torch.Tensor:
    """UTF-8 byte length of every vocabulary entry (0 for special tokens)."""
    vocab = tok.get_vocab()
    lengths = torch.zeros(tok.get_vocab_size(), dtype=torch.long)
    for token, idx in vocab.items():
        if token in SPECIAL_TOKENS:
            continue
        # ByteLevel maps every byte to exactly one printable character.
        lengths[idx] = len(token)
    return lengths


# --------------------------------------------------------------------------------------------
# model card
# --------------------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def md_table(rows: list[tuple[str, str]], header: tuple[str, str] = ("", "")) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def write_model_card(out: Path, info: dict) -> None:
    s = info
    threads = f"{s['threads']} CPU thread" + ("s" if s["threads"] != 1 else "")
    history = f"trained from scratch in {s['wall_min']:.1f} minutes on {threads}"
    if s["init_from"]:
        history = (
            f"whose training continued `{s['init_from']}` (held-out {s['init_bpb']:.3f} bits/byte) "
            f"for {s['wall_min']:.1f} minutes on {threads}"
        )
    plain_pct = 100 - s["fim_pct"] - s["chat_pct"]
    train_table = md_table(
        [
            (
                "corpus",
                f"`Lib/**/*.py` of CPython {s['python']} ({s['n_files']} files, "
                f"{s['corpus_mb']:.2f} MB), excluding directories {s['excluded']}",
            ),
            ("corpus sha256", f"`{s['corpus_sha']}`"),
            (
                "held-out split",
                f"every {s['holdout_every']}th file by sorted path: "
                f"{s['n_heldout']} files, {s['heldout_kb']:.0f} kB",
            ),
            *(
                [("training text", "the files without docstrings or comments (`--code-only`)")]
                if s["code_only"]
                else []
            ),
            ("training tokens (corpus)", f"{s['train_tokens']:,}"),
            *(
                [
                    (
                        "initialised from",
                        f"`{s['init_from']}` (held-out {s['init_bpb']:.3f} bits/byte)",
                    )
                ]
                if s["init_from"]
                else []
            ),
            ("seed", str(s["seed"])),
            (
                "steps × batch × sequence",
                f"{s['steps']} × {s['batch_size']} × {s['seq_len']} = {s['tokens_seen']:,} tokens "
                f"(~{s['epochs']:.1f} epochs)",
            ),
            (
                "data mix",
                f"{plain_pct:.0f}% plain windows, {s['fim_pct']:.0f}% FIM (PSM), "
                f"{s['chat_pct']:.0f}% ChatML-wrapped code",
            ),
            (
                "optimizer",
                f"AdamW (β=0.9/0.95, wd 0.1 on matrices), peak LR {s['lr']:g}, "
                f"{s['warmup']} warmup steps, cosine to {s['min_lr_ratio']:g}×, "
                "grad clip 1.0",
            ),
            *(
                [
                    (
                        "loss against greedy loops",
                        f"weight {s['unlikelihood']:g}: each step, {s['rollout_batch']} greedy "
                        f"continuations of {s['rollout_tokens']} tokens of training prefixes; "
                        "their tokens that say a span a third time in a row get "
                        "-log(1 - p) (`scripts/demo_loops.py`)",
                    )
                ]
                if s["unlikelihood"]
                else []
            ),
            ("precision", "fp32 master weights, bf16 autocast; saved as bf16"),
            (
                "wall time",
                f"{s['wall_min']:.1f} min total (tokenizer {s['tok_s']:.0f} s, training "
                f"{s['train_min']:.1f} min at {s['train_tps']:,.0f} tokens/s), including "
                "evaluation and saving; as measured, so it depends on other load on the "
                "machine (idle, this 2-core machine trains at roughly 4-5k tokens/s)",
            ),
            (
                "machine",
                f"{s['cpu']}, {s['threads']} torch threads, no GPU; torch {s['torch']}, "
                f"transformers {s['transformers']}, tokenizers {s['tokenizers']}",
            ),
        ]
    )
    eval_table = md_table(
        [
            (
                "held-out loss",
                f"**{s['eval_loss']:.3f} nats/token** (uniform over the vocabulary: "
                f"{math.log(s['vocab']):.2f})",
            ),
            ("held-out bits per byte", f"**{s['eval_bpb']:.3f}**"),
            (
                "held-out bits per byte, files without docstrings or comments",
                f"{s['code_bpb']:.3f}"
                + (f" (before: {s['init_code_bpb']:.3f})" if s["init_code_bpb"] else ""),
            ),
            (
                "held-out tokens / bytes",
                f"{s['eval_tokens']:,} / {s['eval_bytes']:,} "
                f"({s['eval_bytes'] / s['eval_tokens']:.2f} bytes per token)",
            ),
            ("final training loss (mean of last 50 steps, mixed data)", f"{s['train_loss']:.3f}"),
            (
                "greedy completions (64 tokens) that look like Python (`scripts/demo_loops.py`)",
                f"{s['looks_test']} of {len(demo_loops.TEST_OPENINGS)} test openings, "
                f"{s['looks_more']} of {len(demo_loops.MORE_OPENINGS)} more",
            ),
        ],
        header=("metric", "value"),
    )
    card = f"""---
license: other
license_name: psf-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
- toy
- code
- python
- nanoserve
---

# nanoserve demo model (toy Python code completer)

A **tiny** ({s["params_m"]:.2f}M parameters) `Qwen3ForCausalLM` {history}, on the Python
standard library's own source code. It ships inside the `nanoserve` package so that
`nanoserve serve` works out of the box with no download, and so that tests and demos have a
real (non-random) checkpoint.

**What it is:** a toy that continues Python source with Python-looking text (indentation,
docstrings, `self.`, `return`, ...) that is mostly nonsense. **What it is not:** a chat
assistant or a useful model for anything. It has a ChatML chat template, and a small share of
its training windows were ChatML- and fill-in-the-middle-shaped
(`<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>`), so chat and FIM requests render and run and
those special tokens are not untrained; expect code-like replies that often run until
`max_tokens` rather than stopping at `<|im_end|>`.

## Architecture

| | |
|---|---|
| architecture | `Qwen3ForCausalLM` (RMSNorm, SwiGLU, RoPE, GQA, QK-norm) |
| parameters | {s["params"]:,} (tied input/output embeddings) |
| layers / hidden / intermediate | {s["layers"]} / {s["hidden"]} / {s["intermediate"]} |
| attention heads / KV heads / head dim | {s["heads"]} / {s["kv_heads"]} / {s["head_dim"]} |
| vocabulary | {s["vocab"]} (byte-level BPE) |
| max position embeddings | {s["max_positions"]} (trained on {s["seq_len"]}-token windows) |
| RoPE theta | {s["rope_theta"]:g} |
| weights | bf16 safetensors, {s["weights_mb"]:.1f} MB |

Tokenizer: byte-level BPE trained with `tokenizers` on the same corpus (GPT-2 style ByteLevel
pre-tokenizer and decoder, {s["vocab"]} tokens including special tokens). Special tokens:
`<|endoftext|>` (document end, eos, pad), `<|im_start|>`, `<|im_end|>` (ChatML),
`<|fim_prefix|>`, `<|fim_middle|>`, `<|fim_suffix|>`. No BOS token is used.
`generation_config.json` lists both `<|endoftext|>` ({s["eot_id"]}) and `<|im_end|>`
({s["im_end_id"]}) as end-of-sequence tokens.

Chat template (Qwen-style ChatML):

```
<|im_start|>{{role}}\\n{{content}}<|im_end|>\\n ...  then, with add_generation_prompt:
<|im_start|>assistant\\n
```

## Training

Command (from the repository root):

```
{s["command"]}
```

{train_table}

## Evaluation

Held-out files (never seen by the tokenizer or the model), non-overlapping {s["seq_len"]}-token
windows, evaluated with the saved bf16 weights in fp32:

{eval_table}

## Samples

Greedy decoding with `transformers`, prompt `{SAMPLE_PROMPT}`, {SAMPLE_TOKENS} new tokens:

```text
{s["sample_greedy"]}
```

Sampled (temperature 0.7, top-p 0.95, `torch.manual_seed(0)`), same prompt:

```text
{s["sample_temp"]}
```

Fill-in-the-middle, greedy (prompt
`<|fim_prefix|>{s["fim_prefix"]!r}<|fim_suffix|>{s["fim_suffix"]!r}<|fim_middle|>`), middle:

```text
{s["sample_fim"]!r}
```

Chat (user message `{s["chat_user"]!r}`), greedy reply:

```
{s["sample_chat"]!r}
```

Greedy completions ({OPENING_TOKENS} tokens) of everyday openings (model output, verbatim):

{s["sample_openings"]}

## License

The weights and tokenizer are derived solely from the CPython standard library source, which
is distributed under the Python Software Foundation License Version 2
(https://docs.python.org/3/license.html). This toy model is provided under the same terms,
with no warranty of any kind.
"""
    (out / "README.md").write_text(card)


# --------------------------------------------------------------------------------------------
# samples
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def load_saved(out: Path):
    """The saved checkpoint in `out` as transformers loads it: (tokenizer, fp32 model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(
        out
    ).float().eval()


def generate_samples(tok, model) -> dict[str, str]:
    eos = model.generation_config.eos_token_id

    def gen(prompt: str, n: int, **kw) -> str:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        res = model.generate(ids, max_new_tokens=n, eos_token_id=eos, pad_token_id=eos[0], **kw)
        return tok.decode(res[0, ids.shape[1] :], skip_special_tokens=True)

    samples = {}
    samples["sample_greedy"] = SAMPLE_PROMPT + gen(SAMPLE_PROMPT, SAMPLE_TOKENS, do_sample=False)
    torch.manual_seed(0)
    samples["sample_temp"] = SAMPLE_PROMPT + gen(
        SAMPLE_PROMPT, SAMPLE_TOKENS, do_sample=True, temperature=0.7, top_p=0.95
    )
    fim_prefix = "def add(a, b):\n"
    fim_suffix = "\n\n\ndef sub(a, b):\n    return a - b\n"
    samples["fim_prefix"], samples["fim_suffix"] = fim_prefix, fim_suffix
    samples["sample_fim"] = gen(
        f"{FIM_PREFIX}{fim_prefix}{FIM_SUFFIX}{fim_suffix}{FIM_MIDDLE}", 32, do_sample=False
    )
    chat_user = "def is_even(n):"
    samples["chat_user"] = chat_user
    chat_prompt = tok.apply_chat_template(
        [{"role": "user", "content": chat_user}], tokenize=False, add_generation_prompt=True
    )
    samples["sample_chat"] = gen(chat_prompt, 64, do_sample=False)
    return samples


def judge_greedy_completions(tok, model) -> dict[str, int | str]:
    """How many greedy completions of the judged openings look like Python (no penalty), and
    the test openings' completions verbatim for the card."""
    info: dict[str, int | str] = {}
    for name, openings in (("test", demo_loops.TEST_OPENINGS), ("more", demo_loops.MORE_OPENINGS)):
        judged = demo_loops.judge_openings(model, tok, openings, OPENING_TOKENS)
        good = info[f"looks_{name}"] = sum(not problems for _, problems in judged.values())
        log(f"greedy completions of {name} openings looking like Python: {good} of {len(openings)}")
        if name == "test":
            texts = (f"```text\n{text}\n```" for text, _ in judged.values())
            info["sample_openings"] = "\n\n".join(texts)
    return info


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps (fixed, not timed)")
    p.add_argument(
        "--time-budget-min",
        type=float,
        default=None,
        help="on a shared machine: stop after this many minutes of training (at most --steps), "
        "the learning rate decaying over the time instead of the steps; the card records the "
        "steps done",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--fim-rate", type=float, default=0.1)
    p.add_argument("--chat-rate", type=float, default=0.1)
    p.add_argument(
        "--code-only",
        action="store_true",
        help="train on the files without their docstrings and comments (held-out bits per byte "
        "are still measured on the files as they are, and also without prose)",
    )
    p.add_argument(
        "--unlikelihood",
        type=float,
        default=0.0,
        help="weight of the loss against greedy loops (demo_loops.py): each step the model "
        "continues --rollout-batch training prefixes greedily and the tokens that repeat a span "
        "a third time are made less likely; 0 turns it off",
    )
    p.add_argument("--rollout-batch", type=int, default=16)
    p.add_argument("--rollout-tokens", type=int, default=64)
    p.add_argument("--holdout-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 (slower on CPU)")
    p.add_argument("--stdlib", type=Path, default=None, help="override the stdlib directory")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue training this checkpoint (its shape and tokenizer) instead of a new model",
    )
    p.add_argument(
        "--samples-of",
        type=Path,
        default=None,
        help="print the greedy samples of this checkpoint directory and exit (no training)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.samples_of is not None:
        saved = load_saved(args.samples_of)
        for name, text in {**generate_samples(*saved), **judge_greedy_completions(*saved)}.items():
            log(f"--- {name}\n{text}")
        return
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import tokenizers
    import transformers
    from transformers import GenerationConfig, Qwen3ForCausalLM

    stdlib = args.stdlib or Path(sysconfig.get_paths()["stdlib"])
    corpus = collect_corpus(stdlib)
    sha = corpus_digest(corpus)
    heldout = [c for i, c in enumerate(corpus) if i % args.holdout_every == 0]
    train = [c for i, c in enumerate(corpus) if i % args.holdout_every != 0]
    if args.code_only:
        train = [(rel, strip_prose(text)) for rel, text in train]
        log(f"code only: {sum(len(t.encode()) for _, t in train) / 1e6:.2f} MB of training text")
    corpus_bytes = sum(len(t.encode()) for _, t in corpus)
    heldout_bytes = sum(len(t.encode()) for _, t in heldout)
    log(f"corpus: {stdlib} -> {len(corpus)} files, {corpus_bytes / 1e6:.2f} MB, sha256 {sha[:16]}")
    log(
        f"held out: {len(heldout)} files ({heldout_bytes / 1e3:.0f} kB): "
        + ", ".join(r for r, _ in heldout)
    )

    # ---- tokenizer (trained here, or the one of the checkpoint training continues from)
    t0 = time.time()
    if args.init_from is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
    else:
        tok = train_tokenizer([t for _, t in train], args.vocab_size)
    tok_s = time.time() - t0
    vocab = tok.get_vocab_size()
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    log(f"tokenizer: vocab {vocab}, trained in {tok_s:.1f} s, special ids {special}")
    eot_id, im_end_id = special[EOT], special[IM_END]

    train_docs = encode_docs(tok, [t for _, t in train])
    train_stream = join_docs(train_docs, eot_id)
    eval_stream = join_docs(encode_docs(tok, [t for _, t in heldout]), eot_id)
    code_eval_stream = join_docs(encode_docs(tok, [strip_prose(t) for _, t in heldout]), eot_id)
    byte_len = token_byte_lengths(tok)
    log(
        f"tokens: train {len(train_stream):,}, held-out {len(eval_stream):,} "
        f"({heldout_bytes / len(eval_stream):.2f} bytes/token)"
    )

    def enc(s: str) -> list[int]:
        return tok.encode(s).ids

    seq_ids = {
        "eot": [eot_id],
        "fim_prefix": [special[FIM_PREFIX]],
        "fim_middle": [special[FIM_MIDDLE]],
        "fim_suffix": [special[FIM_SUFFIX]],
        # exactly what CHAT_TEMPLATE renders around a single user turn
        "user": enc(f"{IM_START}user\n"),
        "end_user": enc(f"{IM_END}\n{IM_START}assistant\n"),
        "end_asst": enc(f"{IM_END}\n"),
    }
    sampler = WindowSampler(
        train_stream, args.seq_len, args.seed, seq_ids, args.fim_rate, args.chat_rate
    )

    # ---- model (new, or a checkpoint to continue training: its shape overrides the flags)
    init_eval = init_code_eval = None
    if args.init_from is not None:
        model = Qwen3ForCausalLM.from_pretrained(args.init_from).float()
        shape = {
            "layers": "num_hidden_layers",
            "hidden": "hidden_size",
            "intermediate": "intermediate_size",
            "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads",
            "head_dim": "head_dim",
            "max_positions": "max_position_embeddings",
        }
        for arg_name, config_key in shape.items():
            setattr(args, arg_name, getattr(model.config, config_key))
        init_eval = evaluate(model, eval_stream, byte_len, args.seq_len, eot_id)
        init_code_eval = evaluate(model, code_eval_stream, byte_len, args.seq_len, eot_id)
        log(
            f"held-out before training ({args.init_from}): loss {init_eval['loss']:.4f} "
            f"nats/token, {init_eval['bpb']:.4f} bits/byte "
            f"({init_code_eval['bpb']:.4f} without docstrings and comments)"
        )
    else:
        model = Qwen3ForCausalLM(build_config(args, vocab, eot_id, im_end_id))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"model: Qwen3ForCausalLM {n_params / 1e6:.2f}M params, "
        f"attn={model.config._attn_implementation}"
    )

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    use_bf16 = not args.no_bf16
    tokens_per_step = args.batch_size * args.seq_len
    t_train = time.time()
    recent: list[float] = []
    recent_loops: list[float] = []  # share of rollout tokens that loop, last 50 steps
    lines = [tok.encode(line).ids for line in demo_loops.opening_lines([t for _, t in train])]
    judged = demo_loops.TEST_OPENINGS + demo_loops.MORE_OPENINGS
    avoid = frozenset(tuple(tok.encode(opening).ids) for opening in judged)
    rollouts = demo_loops.RolloutPrefixes(train_docs, lines, args.seed + 1, avoid)
    budget_s = args.time_budget_min * 60 if args.time_budget_min else None
    for step in range(args.steps):
        time_fraction = (time.time() - t_train) / budget_s if budget_s else None
        if time_fraction is not None and time_fraction >= 1.0:
            log(f"time budget of {args.time_budget_min} min used: stopping after {step} steps")
            args.steps = step
            break
        lr = lr_at(step, args, time_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sampler.batch(args.batch_size)
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.unlikelihood > 0:
            loop_share = loop_step(model, rollouts, args, [eot_id, im_end_id], use_bf16)
            recent_loops = (recent_loops + [loop_share])[-50:]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-50:]
        done = step + 1
        if done % 10 == 0 or done == args.steps or step == 0:
            elapsed = time.time() - t_train
            tps = done * tokens_per_step / elapsed
            eta = (args.steps - done) * elapsed / done
            log(
                f"step {done:5d}/{args.steps} loss {loss.item():.4f} "
                f"(avg50 {sum(recent) / len(recent):.4f}) lr {lr:.2e} {tps:,.0f} tok/s "
                + (
                    f"loops {100 * sum(recent_loops) / max(1, len(recent_loops)):.1f}% "
                    if args.unlikelihood > 0
                    else ""
                )
                + f"elapsed {elapsed / 60:.1f} min eta {eta / 60:.1f} min"
            )
        if args.eval_every and done % args.eval_every == 0 and done != args.steps:
            ev = evaluate(
                model,
                eval_stream,
                byte_len,
                args.seq_len,
                eot_id,
                max_windows=24,
                autocast=use_bf16,
            )
            log(f"  eval@{done} (subset) loss {ev['loss']:.4f} bpb {ev['bpb']:.4f}")
    train_min = (time.time() - t_train) / 60

    # ---- save (bf16) and evaluate exactly what is shipped
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[eot_id, im_end_id], pad_token_id=eot_id
    )
    model.save_pretrained(out, safe_serialization=True)
    add_legacy_config_keys(out / "config.json", args.rope_theta)
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600
    save_tokenizer(tok, out, args.max_positions)
    model = model.to(torch.float32)
    ev = evaluate(model, eval_stream, byte_len, args.seq_len, eot_id)
    log(
        f"held-out (full, bf16 weights, fp32 compute): loss {ev['loss']:.4f} nats/token, "
        f"{ev['bpb']:.4f} bits/byte over {ev['tokens']:,} tokens / {ev['bytes']:,} bytes"
    )
    code_ev = evaluate(model, code_eval_stream, byte_len, args.seq_len, eot_id)
    log(f"held-out without docstrings and comments: {code_ev['bpb']:.4f} bits/byte")

    saved = load_saved(out)
    samples = {**generate_samples(*saved), **judge_greedy_completions(*saved)}
    log("greedy sample:\n" + samples["sample_greedy"])
    log("temperature 0.7 sample:\n" + samples["sample_temp"])
    log(f"fim middle: {samples['sample_fim']!r}")
    log(f"chat reply: {samples['sample_chat']!r}")

    weights_mb = (out / "model.safetensors").stat().st_size / 1e6
    wall_min = (time.time() - t_start) / 60
    cmd = " ".join(["python", "scripts/train_demo_model.py", *(argv or sys.argv[1:])]).strip()
    info = {
        **samples,
        "command": cmd,
        "params": n_params,
        "params_m": n_params / 1e6,
        "layers": args.layers,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab": vocab,
        "max_positions": args.max_positions,
        "seq_len": args.seq_len,
        "rope_theta": args.rope_theta,
        "weights_mb": weights_mb,
        "eot_id": eot_id,
        "im_end_id": im_end_id,
        "python": platform.python_version(),
        "n_files": len(corpus),
        "corpus_mb": corpus_bytes / 1e6,
        "excluded": ", ".join(f"`{d}`" for d in sorted(EXCLUDED_DIRS)),
        "corpus_sha": sha,
        "holdout_every": args.holdout_every,
        "n_heldout": len(heldout),
        "heldout_kb": heldout_bytes / 1e3,
        "train_tokens": len(train_stream),
        "seed": args.seed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "tokens_seen": args.steps * tokens_per_step,
        "epochs": args.steps * tokens_per_step / len(train_stream),
        "fim_pct": 100 * args.fim_rate,
        "chat_pct": 100 * args.chat_rate,
        "lr": args.lr,
        "warmup": args.warmup,
        "min_lr_ratio": args.min_lr_ratio,
        "tok_s": tok_s,
        "train_min": train_min,
        "train_tps": args.steps * tokens_per_step / (train_min * 60),
        "wall_min": wall_min,
        "cpu": cpu_name(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "eval_loss": ev["loss"],
        "eval_bpb": ev["bpb"],
        "eval_tokens": ev["tokens"],
        "eval_bytes": ev["bytes"],
        "train_loss": sum(recent) / len(recent),
        "init_from": args.init_from,
        "init_bpb": init_eval["bpb"] if init_eval else None,
        "init_code_bpb": init_code_eval["bpb"] if init_code_eval else None,
        "code_bpb": code_ev["bpb"],
        "code_only": args.code_only,
        "unlikelihood": args.unlikelihood,
        "rollout_batch": args.rollout_batch,
        "rollout_tokens": args.rollout_tokens,
    }
    write_model_card(out, info)
    total_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    log(f"saved {out} ({total_mb:.1f} MB): " + ", ".join(sorted(f.name for f in out.iterdir())))
    log(f"total wall time {wall_min:.1f} min")


if __name__ == "__main__":
    main()
