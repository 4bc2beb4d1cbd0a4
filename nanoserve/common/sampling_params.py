"""SamplingParams: how to pick each next token and when to stop, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on the output, in vLLM's `structured_outputs` shape; set exactly one field.

    `json` is a JSON schema (a dict or its text), `regex` a regular expression the whole output
    matches, `choice` a list of strings the output is one of, `grammar` a Lark (or GBNF)
    grammar, `json_object` any JSON object. Enforced token by token in the worker
    (`nanoserve.structured_output`).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        chosen = [
            kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)
        ]
        _require(
            len(chosen) == 1,
            "structured_outputs must set exactly one of "
            f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got {chosen or 'none'}",
        )
        if self.choice is not None:
            _require(
                bool(self.choice) and all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice must be a non-empty list of non-empty strings",
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters, in vLLM's shape.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    `max_tokens=None` means "until the context is full"; `max_tokens=0` runs the prompt only
    and generates nothing (with `prompt_logprobs`: score a prompt, as lm-eval does).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's plus the top k alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        _require(self.n >= 1, f"n must be ≥ 1, got {self.n}")
        _require(self.temperature >= 0.0, f"temperature must be ≥ 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, f"top_k must be -1 or 0 (disabled) or ≥ 1, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _require(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _require(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _require(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _require(
            self.max_tokens is None or self.max_tokens >= 0,
            f"max_tokens must be ≥ 1 (or 0 to run the prompt only), got {self.max_tokens}",
        )
        _require(self.min_tokens >= 0, f"min_tokens must be ≥ 0, got {self.min_tokens}")
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be ≤ max_tokens ({self.max_tokens})",
        )
        _require(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        _require(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop must be a non-empty string or a list of non-empty strings",
        )
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}",
        )
        if self.seed is not None:
            _require(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        if self.logit_bias:
            bad = [v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0]
            _require(not bad, f"logit_bias values must be in [-100, 100], got {bad[:3]}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids in `logit_bias` and `stop_token_ids`."""
        ids = list(self.logit_bias or {}) + self.stop_token_ids
        bad = [i for i in ids if not 0 <= i < vocab_size]
        _require(not bad, f"token ids must be in [0, {vocab_size}), got {bad[:5]}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
