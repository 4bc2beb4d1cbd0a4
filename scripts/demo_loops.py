"""Greedy loops of the demo model: how to recognise them, and a training loss against them.

A 4-million-parameter model decoding greedily tends to fall into a cycle (``self.is_is_is``,
``import os`` again and again, a blank line forty times): once a span has been said twice, the
likeliest next token says it a third time. Lowering the held-out loss did not cure this (see
``benchmarks/RESULTS.md``), so the training script can add an *unlikelihood* term (Welleck et
al., 2019, "Neural Text Generation with Unlikelihood Training"): it lets the model continue
prefixes of its training files greedily, finds the tokens of those continuations that repeat a
span for the third time in a row, and lowers their probability with ``-log(1 - p)``. Tokens
that are not part of a loop, and all of the training text, keep the ordinary loss.

``python_looks`` is the judge the tests use on the shipped model's greedy completions; the
openings it judges are never rollout prefixes (the shipped run predates leaving out file
starts equal to one: see its model card).
"""

from __future__ import annotations

import itertools
import random
import re

import torch

# The openings the tests complete greedily (tests/test_demo_model.py).
TEST_OPENINGS = (
    "import os",
    "def read_lines(path):",
    "class Stack:",
    "for i in range(10):",
    'if __name__ == "__main__":',
    "def fibonacci(n):",
)

# More everyday openings, only for reporting: does a change generalise beyond the six above?
MORE_OPENINGS = (
    "import sys",
    "def main():",
    "class Node:",
    "with open(path) as f:",
    "try:",
    "while True:",
    "def __init__(self, name):",
    "from collections import defaultdict",
    "def parse_args(argv=None):",
    "class Config(object):",
    "def add(a, b):",
    "for line in lines:",
    "def __repr__(self):",
    "import json",
    "def is_prime(n):",
    "class Error(Exception):",
    "def read_config(filename):",
    "if x is None:",
    "def sort_items(items):",
    "def get(self, key, default=None):",
    "import re",
    "def write(self, data):",
    "result = []",
    "def test_add():",
)


def python_looks(text: str) -> list[str]:
    """What keeps `text` from looking like Python: too few lines, no indented line, no code
    word after the first line, a line said three times in a row, or a run of 1-6 words said
    four times in a row (`self.is_is_is_is`, `Attributes, Attributes, ...`)."""
    lines = [line for line in text.splitlines() if line.strip()]
    problems = []
    if len(lines) < 4:
        problems.append(f"{len(lines)} lines")
    if not any(line.startswith((" ", "\t")) for line in lines):
        problems.append("no indented line")
    if not re.search(r"\b(return|if|def|import|for|self)\b|=", "\n".join(lines[1:])):
        problems.append("no code word")
    if max(len(list(run)) for _, run in itertools.groupby(lines)) > 2:
        problems.append("a line repeats")
    words = re.findall(r"[A-Za-z0-9]+", text)
    for n in range(1, 7):
        for i in range(len(words) - 4 * n + 1):
            if all(words[i + k * n : i + (k + 1) * n] == words[i : i + n] for k in range(4)):
                problems.append(f"loops on {' '.join(words[i : i + n])!r}")
                return problems
    return problems


def loop_mask(tokens: torch.Tensor, start: int, max_period: int = 32) -> torch.Tensor:
    """Which tokens at or after `start` begin (or continue) a third copy of a span.

    tokens: [B, T] ids. Token t is marked when, for some period p <= max_period, the p + 1
    tokens ending at t each equal the token p before them: the last 2p tokens before t were one
    span said twice, and t says it again. Returns a [B, T] bool mask (False before `start`).
    """
    length = tokens.shape[1]
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for p in range(1, min(max_period, (length - 1) // 2) + 1):
        same = tokens[:, p:] == tokens[:, :-p]  # [B, T - p]: token i + p equals token i
        third = same.unfold(1, p + 1, 1).all(-1)  # [B, T - 2p]: p + 1 in a row, ending at 2p + i
        mask[:, 2 * p :] |= third
    mask[:, :start] = False
    return mask


class RolloutPrefixes:
    """Seeded prefixes of the training files for the model to continue, in three kinds: a
    file's first 2-48 tokens; 16-96 tokens from the middle of a file; or one line of a file
    alone, without its indentation or anything before it, as a user's opening would be (lines
    equal to one of the openings above are left out, and so are file starts whose ids are
    `avoid`'s, so those openings stay unseen as prefixes). One length per batch, so no padding
    is needed."""

    def __init__(
        self,
        docs: list[list[int]],
        lines: list[list[int]],
        seed: int,
        avoid: frozenset[tuple[int, ...]] = frozenset(),
    ) -> None:
        self.docs = [d for d in docs if len(d) >= 200]
        self.avoid = avoid  # token ids of the judged openings: never a whole prefix
        self.lines_by_length: dict[int, list[list[int]]] = {}
        for line in lines:
            self.lines_by_length.setdefault(len(line), []).append(line)
        self.line_lengths = [n for n, group in self.lines_by_length.items() if len(group) >= 64]
        self.rng = random.Random(seed)

    def batch(self, batch_size: int) -> torch.Tensor:
        rng = self.rng
        kind = rng.randrange(3 if self.line_lengths else 2)  # no lines: no third kind
        if kind == 0:
            n = rng.randint(2, 48)
            starts = [d[:n] for d in self.docs if tuple(d[:n]) not in self.avoid]
            rows = [rng.choice(starts) for _ in range(batch_size)]
        elif kind == 1:
            n = rng.randint(16, 96)
            rows = []
            for _ in range(batch_size):
                doc = rng.choice(self.docs)
                s = rng.randrange(len(doc) - n)
                rows.append(doc[s : s + n])
        else:
            group = self.lines_by_length[rng.choice(self.line_lengths)]
            rows = [rng.choice(group) for _ in range(batch_size)]
        return torch.tensor(rows, dtype=torch.long)  # [B, n]


def opening_lines(texts: list[str]) -> list[str]:
    """The lines of `texts` that could open a user's snippet: stripped of indentation, 8-80
    characters, starting with a letter, and not one of the openings that are judged."""
    judged = set(TEST_OPENINGS) | set(MORE_OPENINGS)
    found = set()
    for text in texts:
        for line in text.splitlines():
            line = line.strip()
            if 8 <= len(line) <= 80 and line[0].isalpha() and line not in judged:
                found.add(line)
    return sorted(found)


@torch.no_grad()
def greedy_rollouts(model, prefixes: torch.Tensor, new_tokens: int, eos: list[int]):
    """The model's greedy continuations of `prefixes` ([B, n]), all `new_tokens` long (end of
    sequence is held off): [B, n + new_tokens] ids."""
    was_training = model.training
    model.eval()
    out = model.generate(
        prefixes,
        attention_mask=torch.ones_like(prefixes),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # no early stop: keeps every row the same length
        do_sample=False,
        repetition_penalty=1.0,  # the model's own choice, whatever its generation config says
        pad_token_id=eos[0],
    )
    model.train(was_training)
    return out


def unlikelihood_loss(
    logits: torch.Tensor, tokens: torch.Tensor, marked: torch.Tensor, generated: int
) -> tuple[torch.Tensor, int]:
    """Sum of -log(1 - p(token)) over the marked tokens, divided by the `generated` count.

    logits: [B, T, V] for the rollout `tokens` [B, T]; marked: [B, T] bool (position 0 is never
    marked: nothing predicts it). Returns (loss, number of marked tokens).
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    p_tok = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1).exp()  # [B, T-1]
    one_minus = torch.clamp(1.0 - p_tok, min=1e-5)
    hits = marked[:, 1:]
    loss = -(torch.log(one_minus) * hits).sum() / max(1, generated)
    return loss, int(hits.sum())


@torch.no_grad()
def judge_openings(model, tok, openings, new_tokens: int = 64, penalty: float = 1.0):
    """Greedy completions of `openings` (transformers' generate, as the tests run it) and what
    `python_looks` finds wrong with each: {opening: (text, problems)}."""
    eos = model.generation_config.eos_token_id
    results = {}
    for opening in openings:
        ids = tok(opening, return_tensors="pt")["input_ids"]
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            repetition_penalty=penalty,
            pad_token_id=eos[0] if isinstance(eos, list) else eos,
        )
        text = opening + tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        results[opening] = (text, python_looks(text))
    return results


def main() -> None:
    """Print how many greedy completions of the test and the extra openings look like Python,
    for the checkpoint directories named on the command line."""
    import argparse

    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--penalty", type=float, default=1.0, help="repetition penalty (default 1.0)")
    p.add_argument("--show", action="store_true", help="print every failing completion")
    args = p.parse_args()
    for path in args.checkpoints:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).float().eval()
        for name, openings in (("test", TEST_OPENINGS), ("more", MORE_OPENINGS)):
            results = judge_openings(model, tok, openings, penalty=args.penalty)
            good = [o for o, (_, problems) in results.items() if not problems]
            print(f"{path} {name}: {len(good)} of {len(openings)} look like Python", flush=True)
            if args.show:
                for text, problems in results.values():
                    if problems:
                        print(f"--- {problems}\n{text}")


if __name__ == "__main__":
    main()
