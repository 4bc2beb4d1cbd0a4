"""The four workloads as lists of phases of prompts, made once and sent byte-for-byte to every arm.

All randomness comes from one seed, so two runs (and two arms) send the same requests.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

WORKLOADS = ("scoreboard", "sweep", "autocomplete", "shared-prefix")

# Scoreboard prompts: short chat-style requests, the kind a public bake-off sends.
SCOREBOARD_PROMPTS = (
    "Explain in simple terms how a hash table works.",
    "Write a short poem about the sea at night.",
    "What are three tips for writing readable Python code?",
    "Summarize the plot of a detective story in two sentences.",
    "Describe the water cycle to a ten year old.",
    "List five uses of a paperclip that are not holding paper.",
    "Why is the sky blue? Answer briefly.",
    "Give a recipe for a quick vegetable soup.",
)


@dataclass
class Phase:
    """One measured run of requests against an arm, e.g. the sweep at concurrency 8."""

    label: str
    prompts: list[str]
    max_tokens: int
    ignore_eos: bool = False
    max_concurrency: int | None = None  # None: no limit
    request_rate: float = float("inf")  # requests/s with Poisson arrivals; inf: all at once
    send_times_s: list[float] | None = None  # autocomplete: fixed send times, drop the previous
    groups: list[int] | None = None  # shared-prefix: group of each prompt
    params: dict = field(default_factory=dict)


@dataclass
class Workload:
    """A named list of phases plus the parameters that made them (written to the JSON)."""

    name: str
    phases: list[Phase]
    params: dict


class PromptMaker:
    """Random text of an exact number of tokens of the model's tokenizer."""

    def __init__(self, model_dir: str | Path, seed: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.rng = random.Random(seed)

    def num_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def random_text(self, num_tokens: int) -> str:
        """Lower-case pseudo-words cut to `num_tokens` tokens (exact for byte-level vocabs)."""
        words: list[str] = []
        ids: list[int] = []
        while len(ids) < num_tokens:
            for _ in range(max(8, num_tokens // 4)):
                length = self.rng.randint(2, 9)
                words.append("".join(self.rng.choices(string.ascii_lowercase, k=length)))
            ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False)
        # decode returns list[str] only for a batch of id lists; this is one list of ids.
        return cast(str, self.tokenizer.decode(ids[:num_tokens]))


def scoreboard(num_prompts: int, max_tokens: int, concurrency: int) -> Workload:
    prompts = [
        SCOREBOARD_PROMPTS[i % len(SCOREBOARD_PROMPTS)]
        + ("" if i < len(SCOREBOARD_PROMPTS) else f" (variant {i // len(SCOREBOARD_PROMPTS)})")
        for i in range(num_prompts)
    ]
    phases = [
        Phase("c=1", prompts, max_tokens, max_concurrency=1, params={"concurrency": 1}),
        Phase(
            f"c={concurrency}",
            prompts,
            max_tokens,
            max_concurrency=concurrency,
            params={"concurrency": concurrency},
        ),
    ]
    params = {"num_prompts": num_prompts, "max_tokens": max_tokens, "concurrency": concurrency}
    return Workload("scoreboard", phases, params)


def sweep(
    maker: PromptMaker,
    concurrencies: list[int],
    input_len: int,
    output_len: int,
    num_prompts: int | None,
    request_rate: float,
    range_ratio: float = 0.0,
) -> Workload:
    """Random prompts at each concurrency level: `input_len` tokens each, or, with a
    `range_ratio` r (vLLM's bench's --random-range-ratio), lengths drawn uniformly from
    [input_len (1 - r), input_len (1 + r)], as real traffic's lengths vary."""
    phases = []
    lowest = round(input_len * (1 - range_ratio))
    highest = round(input_len * (1 + range_ratio))
    for concurrency in concurrencies:
        count = num_prompts or max(8, 2 * concurrency)
        lengths = [input_len] * count  # (no draw when fixed: the same prompts as before)
        if range_ratio > 0:
            lengths = [maker.rng.randint(max(1, lowest), highest) for _ in range(count)]
        prompts = [maker.random_text(length) for length in lengths]
        phases.append(
            Phase(
                f"c={concurrency}",
                prompts,
                output_len,
                ignore_eos=True,
                max_concurrency=concurrency,
                request_rate=request_rate,
                params={"concurrency": concurrency},
            )
        )
    params = {
        "concurrencies": concurrencies,
        "input_len": input_len,
        "random_range_ratio": range_ratio,
        "output_len": output_len,
        "num_prompts_per_level": num_prompts or "max(8, 2 × concurrency)",
        "request_rate": request_rate,
    }
    return Workload("sweep", phases, params)


def default_autocomplete_source() -> Path:
    """A Python file every installation has (the standard library's textwrap)."""
    import textwrap

    return Path(textwrap.__file__)


def autocomplete(
    source: Path,
    context_chars: int,
    typed_chars: int,
    typing_cps: float,
    debounce_ms: float,
    max_tokens: int,
    seed: int,
) -> Workload:
    """Type `typed_chars` characters of `source` after `context_chars` already in the buffer.

    Keystroke gaps are uniform in [0.5, 1.5] / typing_cps, plus a 0.5–1.5 s pause after each
    newline. A completion of everything typed so far is sent `debounce_ms` after a keystroke
    when no other keystroke came in between; sending it drops the previous one if it runs.
    """
    text = source.read_text(encoding="utf-8")
    if len(text) < context_chars + typed_chars:
        raise ValueError(
            f"{source} has {len(text)} characters; autocomplete needs context_chars + "
            f"typed_chars = {context_chars + typed_chars}"
        )
    if typing_cps <= 0 or debounce_ms < 0:
        raise ValueError(
            f"typing speed must be > 0 chars/s and debounce ≥ 0 ms, got {typing_cps}, {debounce_ms}"
        )
    rng = random.Random(seed)
    key_times = []
    now = 0.0
    for k in range(typed_chars):
        now += rng.uniform(0.5, 1.5) / typing_cps
        if k > 0 and text[context_chars + k - 1] == "\n":
            now += rng.uniform(0.5, 1.5)
        key_times.append(now)
    debounce_s = debounce_ms / 1000.0
    prompts, send_times = [], []
    for k, at in enumerate(key_times):
        is_last = k + 1 == len(key_times)
        if is_last or key_times[k + 1] > at + debounce_s:
            prompts.append(text[: context_chars + k + 1])
            send_times.append(at + debounce_s)
    phase = Phase("typing", prompts, max_tokens, send_times_s=send_times)
    params = {
        "source": str(source),
        "context_chars": context_chars,
        "typed_chars": typed_chars,
        "typing_cps": typing_cps,
        "debounce_ms": debounce_ms,
        "max_tokens": max_tokens,
        "num_keystrokes": typed_chars,
        "num_requests": len(prompts),
        "typing_time_s": key_times[-1] if key_times else 0.0,
    }
    return Workload("autocomplete", [phase], params)


def shared_prefix(
    maker: PromptMaker,
    num_groups: int,
    prompts_per_group: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    max_concurrency: int,
    request_rate: float,
) -> Workload:
    """Groups of prompts that share a `prefix_len`-token system prompt, sent group by group."""
    prompts, groups = [], []
    for group in range(num_groups):
        prefix = maker.random_text(prefix_len)
        for _ in range(prompts_per_group):
            question = maker.random_text(question_len)
            prompts.append(f"{prefix}\n\nQuestion: {question}\nAnswer:")
            groups.append(group)
    phase = Phase(
        f"c={max_concurrency}",
        prompts,
        output_len,
        ignore_eos=True,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        groups=groups,
        params={"concurrency": max_concurrency},
    )
    params = {
        "num_groups": num_groups,
        "prompts_per_group": prompts_per_group,
        "prefix_len": prefix_len,
        "question_len": question_len,
        "output_len": output_len,
        "max_concurrency": max_concurrency,
        "request_rate": request_rate,
    }
    return Workload("shared-prefix", [phase], params)


def for_round(workload: Workload, round_index: int) -> Workload:
    """The workload's prompts behind a per-round prefix, for `--rounds`.

    A server that already saw a prompt would answer it from its prefix cache the second time
    round (and only block-aligned caches would notice), so every round starts each prompt with
    its own words. Prompts of one round still share what they shared before (a shared-prefix
    group's system prompt, the text typed so far).
    """
    salt = f"Round {round_index + 1}. "
    phases = [
        replace(phase, prompts=[salt + p for p in phase.prompts]) for phase in workload.phases
    ]
    return replace(workload, phases=phases)


def pooled(rounds: list[Workload]) -> Workload:
    """One workload whose phases hold every round's prompts in order (groups kept apart)."""
    first = rounds[0]
    phases = []
    for index, phase in enumerate(first.phases):
        per_round = [w.phases[index] for w in rounds]
        groups: list[int] | None = None
        send_times_s: list[float] | None = None
        # Every round is a salted copy of the first, so its phases have the same fields set.
        if phase.groups is not None:
            span = max(phase.groups) + 1
            groups = []
            for r, p in enumerate(per_round):
                assert p.groups is not None
                groups += [g + r * span for g in p.groups]
        if phase.send_times_s is not None:
            send_times_s = []
            for p in per_round:
                assert p.send_times_s is not None
                send_times_s += p.send_times_s
        prompts = [q for p in per_round for q in p.prompts]
        phases.append(replace(phase, prompts=prompts, groups=groups, send_times_s=send_times_s))
    return replace(first, phases=phases)
