"""SamplingBatch: one step's per-request sampling parameters as per-row tensors.

The model runner builds one per step (`SamplingBatch.build`) for the requests that sample; the
sampler reads it. Tensors for a feature no row uses are None, so the sampler skips that work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.grammar import GrammarMasks


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator for one seeded request, on the device its logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingBatch:
    """The sampling parameters of one step's batch as tensors, one row per request.

    Tensors for a feature no row uses are None, so the sampler skips that work. The common
    decode step (all greedy, nothing else) holds no tensors at all.
    """

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    is_greedy: torch.Tensor | None  # [B] bool; None unless greedy and random rows are mixed
    temperature: torch.Tensor | None  # [B, 1] float, 1.0 on greedy rows; None when all greedy
    top_k: torch.Tensor | None  # [B] long in [1, V], V = keep all; None when no row filters
    max_top_k: int  # the largest k < V in the batch (how many values one topk must return)
    top_p_threshold: torch.Tensor | None  # [B, 1] float: 1 - top_p, or -1 where disabled
    min_p: torch.Tensor | None  # [B, 1] float, 0 = disabled
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, ids, values [N]
    repetition_penalty: torch.Tensor | None  # [B, 1] float, 1.0 = none
    seen_mask: torch.Tensor | None  # [B, V] bool: token in the prompt or the output
    presence_penalty: torch.Tensor | None  # [B, 1] float
    frequency_penalty: torch.Tensor | None  # [B, 1] float
    output_counts: torch.Tensor | None  # [B, V] float: times each token was generated
    banned: tuple[torch.Tensor, torch.Tensor] | None  # rows, ids [N]: at -inf (min_tokens)
    seeded_rows: list[tuple[int, torch.Generator]]  # random rows that bring their own RNG
    logprob_rows: list[int]  # the R rows that asked for logprobs
    num_logprobs: list[int]  # [R]: how many top alternatives each of them wants
    logprob_index: torch.Tensor | None  # [R] long: logprob_rows on the device; None when R = 0
    grammar_masks: GrammarMasks | None = None  # structured output; set once computed

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        *,
        eos_token_ids: frozenset[int],
    ) -> SamplingBatch:
        """Turn per-request parameters and token histories into per-row tensors on `device`."""
        num_reqs = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_reqs:
            raise ValueError(
                f"SamplingBatch.build needs one entry per request in every list, got "
                f"{num_reqs} params, {len(prompt_token_ids)} prompts, "
                f"{len(output_token_ids)} outputs and {len(generators)} generators"
            )
        rows = _Rows(params, device)
        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        seeded_rows = [(i, g) for i, g in enumerate(generators) if g is not None and not greedy[i]]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            num_reqs=num_reqs,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            is_greedy=rows.tensor(greedy, torch.bool) if any(greedy) and not all_greedy else None,
            **_warpers(rows, vocab_size, all_greedy),
            logit_bias=_logit_bias(rows),
            **_repetition(rows, prompt_token_ids, output_token_ids, vocab_size),
            **_presence_frequency(rows, output_token_ids, vocab_size),
            banned=_banned(rows, output_token_ids, eos_token_ids, vocab_size),
            seeded_rows=seeded_rows,
            logprob_rows=logprob_rows,
            num_logprobs=[params[i].logprobs or 0 for i in logprob_rows],
            logprob_index=rows.tensor(logprob_rows, torch.long) if logprob_rows else None,
        )

    @property
    def needs_penalties(self) -> bool:
        return any(
            x is not None
            for x in (self.logit_bias, self.repetition_penalty, self.output_counts, self.banned)
        )


class _Rows:
    """The batch's parameters and where their tensors go, for the builders below."""

    def __init__(self, params: list[SamplingParams], device: torch.device) -> None:
        self.params = params
        self.device = device

    def tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:  # [B]
        return torch.tensor(values, dtype=dtype, device=self.device)

    def column(self, values: list[float]) -> torch.Tensor:  # [B, 1] float
        return self.tensor(values, torch.float32).unsqueeze(1)


def _warpers(rows: _Rows, vocab_size: int, all_greedy: bool) -> dict[str, Any]:
    """temperature, top-k, top-p and min-p; they only matter for random rows."""
    fields: dict[str, Any] = {
        "temperature": None,
        "top_k": None,
        "max_top_k": 0,
        "top_p_threshold": None,
        "min_p": None,
    }
    if all_greedy:  # a greedy row takes the argmax before the warpers
        return fields
    params = rows.params
    is_random = [p.temperature > 0.0 for p in params]
    fields["temperature"] = rows.column([p.temperature or 1.0 for p in params])
    ks = [
        min(p.top_k, vocab_size) if random and p.top_k > 0 else vocab_size
        for p, random in zip(params, is_random, strict=True)
    ]
    fields["max_top_k"] = max((k for k in ks if k < vocab_size), default=0)
    if fields["max_top_k"]:
        fields["top_k"] = rows.tensor(ks, torch.long)
    if any(p.top_p < 1.0 and random for p, random in zip(params, is_random, strict=True)):
        fields["top_p_threshold"] = rows.column(
            [
                1.0 - p.top_p if random and p.top_p < 1.0 else -1.0
                for p, random in zip(params, is_random, strict=True)
            ]
        )
    if any(p.min_p > 0.0 and random for p, random in zip(params, is_random, strict=True)):
        fields["min_p"] = rows.column(
            [p.min_p if random else 0.0 for p, random in zip(params, is_random, strict=True)]
        )
    return fields


def _logit_bias(rows: _Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if not any(p.logit_bias for p in rows.params):
        return None
    biased = [list((p.logit_bias or {}).items()) for p in rows.params]
    row_ids, token_ids = _flatten([[t for t, _ in items] for items in biased], rows.device)
    values = [b for items in biased for _, b in items]
    return row_ids, token_ids, rows.tensor(values, torch.float32)


def _repetition(
    rows: _Rows, prompt_ids: list[list[int]], output_ids: list[list[int]], vocab_size: int
) -> dict[str, Any]:
    """The repetition penalty per row and which tokens each row has seen (prompt + output)."""
    params = rows.params
    if all(p.repetition_penalty == 1.0 for p in params):
        return {"repetition_penalty": None, "seen_mask": None}
    seen = [
        prompt_ids[i] + output_ids[i] if p.repetition_penalty != 1.0 else []
        for i, p in enumerate(params)
    ]
    seen_mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=rows.device)
    seen_mask[_flatten(seen, rows.device)] = True
    return {
        "repetition_penalty": rows.column([p.repetition_penalty for p in params]),
        "seen_mask": seen_mask,
    }


def _presence_frequency(
    rows: _Rows, output_ids: list[list[int]], vocab_size: int
) -> dict[str, Any]:
    """The presence and frequency penalties per row and each row's output token counts."""
    params = rows.params
    if all(p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params):
        return {"presence_penalty": None, "frequency_penalty": None, "output_counts": None}
    counted = [
        output_ids[i] if p.presence_penalty or p.frequency_penalty else []
        for i, p in enumerate(params)
    ]
    counts = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=rows.device)
    row_ids, token_ids = _flatten(counted, rows.device)
    counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=torch.float32), True)
    return {
        "presence_penalty": rows.column([p.presence_penalty for p in params]),
        "frequency_penalty": rows.column([p.frequency_penalty for p in params]),
        "output_counts": counts,
    }


def _banned(
    rows: _Rows, output_ids: list[list[int]], eos_token_ids: frozenset[int], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Until min_tokens are out, the tokens that would end a request cannot be sampled.

    With ignore_eos, EOS does not end it, so only the stop ids are masked (as in vLLM).
    """
    params = rows.params
    if not any(len(output_ids[i]) < p.min_tokens for i, p in enumerate(params)):
        return None
    banned_ids = [
        sorted(
            t
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
            if 0 <= t < vocab_size
        )
        if len(output_ids[i]) < p.min_tokens
        else []
        for i, p in enumerate(params)
    ]
    return _flatten(banned_ids, rows.device)


def _flatten(
    token_lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index and token id of every token in every row: two [N] long tensors."""
    # Built on the CPU: repeat_interleave on a GPU would wait for the lengths to know its size.
    lengths = torch.tensor([len(ids) for ids in token_lists])
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)  # [N]
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    return rows.to(device), ids.to(device)
