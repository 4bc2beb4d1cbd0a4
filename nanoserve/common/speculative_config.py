"""SpeculativeConfig: `--speculative-config`, vLLM's JSON, checked before anything loads.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix"}                     (num_speculative_tokens: the tree depth, 24)
    {"model": "DIR_OR_ID", "num_speculative_tokens": 4}     (a draft model; method "draft_model")

Torch-free: the front validates the flag, the worker builds the speculator from it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer drafts tokens, how many a step, and when speculation steps aside."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model (method draft_model), same tokenizer
    prompt_lookup_min: int = 5  # ngram: the shortest suffix that may match
    prompt_lookup_max: int = 5  # ngram: the longest suffix tried first
    suffix_decoding_max_tree_depth: int = 24  # suffix: the longest substring indexed
    suffix_decoding_max_cached_requests: int = 1000  # suffix: earlier outputs kept
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: draft <= factor x matched length
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop drafting below this estimate
    # No drafts at all in a step where this many requests (or more) are decoding: at large
    # batches verifying drafts costs more than it saves. None: the engine's default (8).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.method in METHODS,
            f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}",
        )
        _require(
            1 <= self.num_speculative_tokens <= 64,
            f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}",
        )
        _require(
            (self.method == "draft_model") == (self.model is not None),
            'a draft model ("model") is given with method draft_model, and only then',
        )
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
            f"({self.prompt_lookup_max})",
        )
        _require(
            self.suffix_decoding_max_tree_depth >= 1
            and self.suffix_decoding_max_cached_requests >= 0
            and 0 < self.suffix_decoding_max_spec_factor < math.inf
            and 0.0 <= self.suffix_decoding_min_token_prob <= 1.0,
            "suffix decoding needs max_tree_depth >= 1, max_cached_requests >= 0, "
            "a finite max_spec_factor > 0 and min_token_prob in [0, 1]",
        )
        _require(
            self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
            f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}",
        )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse vLLM's `--speculative-config` JSON; ValueError says what is wrong."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not valid JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError("--speculative-config must be a JSON object")
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        values = dict(values)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        _require(not unknown, f"unknown speculative-config keys {unknown}; known: {sorted(known)}")
        method = values.get("method") or ("draft_model" if values.get("model") else None)
        _require(method is not None, "speculative-config needs a method or a draft model")
        values["method"] = method
        _fill_defaults(values)
        for name, kind in (("num_speculative_tokens", int), ("prompt_lookup_min", int)):
            _require(
                isinstance(values.get(name, 1), kind) and not isinstance(values.get(name), bool),
                f"{name} must be an integer, got {values.get(name)!r}",
            )
        return cls(**values)


def _fill_defaults(values: dict) -> None:
    """vLLM's defaults: an n-gram bound given alone is the other one too (neither: 5); suffix
    drafts up to the tree depth; the other methods must say how many tokens they draft."""
    low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
    if low is None and high is not None:
        values["prompt_lookup_min"] = high
    if high is None and low is not None:
        values["prompt_lookup_max"] = low
    if values["method"] == "suffix":
        depth = values.get("suffix_decoding_max_tree_depth", 24)
        values.setdefault("num_speculative_tokens", depth)
    _require(
        "num_speculative_tokens" in values,
        f"speculative method {values['method']!r} needs num_speculative_tokens",
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
