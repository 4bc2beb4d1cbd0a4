"""Sampler: turns each request's last-position logits into its next token, for the whole batch.

Each step the model runner builds one `SamplingBatch` (per-request parameters as per-row
tensors) and calls `Sampler()(logits, batch)`. One vectorised pass, in this order:

    raw logits ─▶ logprobs: log_softmax of the raw logits (vLLM's default "raw_logprobs")
        │
        ▼  penalties (they move the argmax)
    logit_bias → repetition penalty (prompt + output tokens) → presence/frequency penalties
    (output tokens) → min_tokens (EOS and stop ids at -inf)        ─▶ greedy rows: argmax here
        │
        ▼  warpers (they keep the argmax; they only shape the distribution)
    temperature → top-k → top-p → min-p ─▶ softmax ─▶ argmax(probs / Exp(1) noise)

The warper order is transformers' (`generate`) and vLLM v0's; vLLM v1 applies min-p before
top-k/top-p, which gives a different result only when min-p and top-k/top-p are combined.

`argmax(p / E)` with `E ~ Exp(1)` i.i.d. draws token i with probability p_i (it is the
Gumbel-max trick, since -log E is Gumbel). A seeded request draws its noise from its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from nanoserve.protocol import TokenLogprobs
from nanoserve.sampling_params import SamplingParams

_NEG_INF = float("-inf")


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
    has_unseeded_random: bool  # some random row draws from the default generator
    logprob_rows: list[int]  # the R rows that asked for logprobs
    num_logprobs: list[int]  # [R]: how many top alternatives each of them wants
    logprob_index: torch.Tensor | None  # [R] long: logprob_rows on the device; None when R = 0

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
        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        random_params = [p for p in params if p.temperature > 0.0]

        def row_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def column(values: list[float]) -> torch.Tensor:  # [B, 1] float
            return row_tensor(values, torch.float32).unsqueeze(1)

        # Warpers only matter for random rows: a greedy row takes the argmax before them.
        temperature = top_k = top_p_threshold = min_p = None
        max_top_k = 0
        if not all_greedy:
            temperature = column([p.temperature or 1.0 for p in params])
            ks = [
                min(p.top_k, vocab_size) if p.temperature > 0.0 and p.top_k > 0 else vocab_size
                for p in params
            ]
            max_top_k = max((k for k in ks if k < vocab_size), default=0)
            if max_top_k:
                top_k = row_tensor(ks, torch.long)
            if any(p.top_p < 1.0 for p in random_params):
                top_p_threshold = column(
                    [
                        1.0 - p.top_p if p.temperature > 0.0 and p.top_p < 1.0 else -1.0
                        for p in params
                    ]
                )
            if any(p.min_p > 0.0 for p in random_params):
                min_p = column([p.min_p if p.temperature > 0.0 else 0.0 for p in params])

        logit_bias = None
        if any(p.logit_bias for p in params):
            biased = [list((p.logit_bias or {}).items()) for p in params]
            rows, ids = _flatten([[t for t, _ in items] for items in biased], device)
            values = [b for items in biased for _, b in items]
            logit_bias = (rows, ids, row_tensor(values, torch.float32))

        repetition_penalty = seen_mask = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition_penalty = column([p.repetition_penalty for p in params])
            seen = [
                prompt_token_ids[i] + output_token_ids[i] if p.repetition_penalty != 1.0 else []
                for i, p in enumerate(params)
            ]
            seen_mask = torch.zeros(num_reqs, vocab_size, dtype=torch.bool, device=device)
            seen_mask[_flatten(seen, device)] = True

        presence_penalty = frequency_penalty = output_counts = None
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            presence_penalty = column([p.presence_penalty for p in params])
            frequency_penalty = column([p.frequency_penalty for p in params])
            counted = [
                output_token_ids[i] if p.presence_penalty or p.frequency_penalty else []
                for i, p in enumerate(params)
            ]
            output_counts = torch.zeros(num_reqs, vocab_size, dtype=torch.float32, device=device)
            rows, ids = _flatten(counted, device)
            output_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), True)

        # Until min_tokens are out, the tokens that would end the request cannot be sampled.
        # With ignore_eos, EOS does not end it, so only the stop ids are masked (as in vLLM).
        banned = None
        if any(len(output_token_ids[i]) < p.min_tokens for i, p in enumerate(params)):
            banned_ids = [
                sorted(
                    t
                    for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
                    if 0 <= t < vocab_size
                )
                if len(output_token_ids[i]) < p.min_tokens
                else []
                for i, p in enumerate(params)
            ]
            banned = _flatten(banned_ids, device)

        seeded_rows = [(i, g) for i, g in enumerate(generators) if g is not None and not greedy[i]]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            num_reqs=num_reqs,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            is_greedy=row_tensor(greedy, torch.bool) if any(greedy) and not all_greedy else None,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p_threshold=top_p_threshold,
            min_p=min_p,
            logit_bias=logit_bias,
            repetition_penalty=repetition_penalty,
            seen_mask=seen_mask,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            output_counts=output_counts,
            banned=banned,
            seeded_rows=seeded_rows,
            has_unseeded_random=len(seeded_rows) < len(random_params),
            logprob_rows=logprob_rows,
            num_logprobs=[params[i].logprobs or 0 for i in logprob_rows],
            logprob_index=row_tensor(logprob_rows, torch.long) if logprob_rows else None,
        )

    @property
    def needs_penalties(self) -> bool:
        return any(
            x is not None
            for x in (self.logit_bias, self.repetition_penalty, self.output_counts, self.banned)
        )


def _flatten(
    token_lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index and token id of every token in every row: two [N] long tensors."""
    # Built on the CPU: repeat_interleave on a GPU would wait for the lengths to know its size.
    lengths = torch.tensor([len(ids) for ids in token_lists])
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)  # [N]
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    return rows.to(device), ids.to(device)


@dataclass
class SamplerOutput:
    """The next token of every request in the batch, and its logprobs where asked for."""

    token_ids: list[int]  # [B]
    logprobs: list[TokenLogprobs | None]  # [B]; None where params.logprobs is None


class Sampler:
    """Picks the next token of every request in one vectorised pass (see the module docstring)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # logits: [B, V] float32, the last position of each request
        if tuple(logits.shape) != (batch.num_reqs, batch.vocab_size):
            raise ValueError(
                f"logits must be [{batch.num_reqs}, {batch.vocab_size}] (one row per request in "
                f"the SamplingBatch), got {list(logits.shape)}"
            )
        raw_logprobs = None
        if batch.logprob_index is not None:
            all_rows = len(batch.logprob_rows) == batch.num_reqs
            selected = logits if all_rows else logits[batch.logprob_index]  # [R, V]
            raw_logprobs = selected.log_softmax(dim=-1)  # [R, V]

        logits = self.apply_penalties(logits, batch)
        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)  # [B]
        else:
            probs = self.apply_warpers(logits, batch).softmax(dim=-1)  # [B, V]
            token_ids = (probs / self._exponential_noise(probs, batch)).argmax(dim=-1)  # [B]
            if batch.is_greedy is not None:
                token_ids = torch.where(batch.is_greedy, logits.argmax(dim=-1), token_ids)

        logprobs: list[TokenLogprobs | None] = [None] * batch.num_reqs
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, token_ids, batch)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits random rows sample from: penalties then warpers, -inf where filtered."""
        logits = self.apply_penalties(logits, batch)
        return logits if batch.all_greedy else self.apply_warpers(logits, batch)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logit_bias, repetition/presence/frequency penalties, min_tokens (into a copy)."""
        if not batch.needs_penalties:
            return logits
        logits = logits.clone()  # [B, V]; the caller's logits stay raw
        if batch.logit_bias is not None:
            rows, ids, values = batch.logit_bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if batch.repetition_penalty is not None:
            # As in the CTRL paper and transformers: a seen token's logit moves towards zero
            # if positive, away from zero if negative, so the penalty always lowers it.
            penalty = batch.repetition_penalty  # [B, 1]
            penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
            logits = torch.where(batch.seen_mask, penalised, logits)
        if batch.output_counts is not None:
            # OpenAI: logit -= frequency * count + presence * (count > 0)
            counts = batch.output_counts  # [B, V]
            logits -= batch.frequency_penalty * counts + batch.presence_penalty * (counts > 0)
        if batch.banned is not None:
            logits[batch.banned] = _NEG_INF
        return logits

    @staticmethod
    def apply_warpers(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """temperature → top-k → top-p → min-p; each filter keeps at least the top token."""
        logits = logits / batch.temperature  # [B, V]
        if batch.top_k is not None:
            logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
        if batch.top_p_threshold is not None:
            logits = apply_top_p(logits, batch.top_p_threshold)
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        return logits

    @staticmethod
    def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # Greedy rows may keep uninitialised noise: their sampled token is replaced by argmax.
        noise = torch.empty_like(probs)  # [B, V]
        if batch.has_unseeded_random:
            noise.exponential_()
        for row, generator in batch.seeded_rows:
            noise[row].exponential_(generator=generator)
        return noise

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
    ) -> list[TokenLogprobs | None]:
        # raw_logprobs: [R, V] for the R rows in batch.logprob_rows
        chosen_ids = token_ids[batch.logprob_index].unsqueeze(1)  # [R, 1]
        chosen = raw_logprobs.gather(1, chosen_ids)  # [R, 1]
        ranks = (raw_logprobs >= chosen).sum(dim=-1)  # [R]; 1 = the most likely token
        top_values, top_ids = raw_logprobs.topk(max(batch.num_logprobs), dim=-1)  # [R, K]

        out: list[TokenLogprobs | None] = [None] * batch.num_reqs
        columns = (
            chosen_ids.squeeze(1).tolist(),
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_values.tolist(),
        )
        for r, (token_id, logprob, rank, ids, values) in enumerate(zip(*columns, strict=True)):
            k = batch.num_logprobs[r]
            out[batch.logprob_rows[r]] = TokenLogprobs(token_id, logprob, rank, ids[:k], values[:k])
        return out


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's k largest logits (and ties with the k-th); top_k [B], V keeps all."""
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [B, 1]
    kth = kth.masked_fill((top_k >= logits.shape[-1]).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches top_p.

    threshold [B, 1] is 1 - top_p: walking up from the least likely token, drop tokens while
    the cumulative probability is <= 1 - top_p, and never the most likely one (transformers).
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # [B, V], ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    drop_sorted = cumulative <= threshold
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, sorted_ids, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one; min_p [B, 1]."""
    probs = logits.softmax(dim=-1)  # [B, V]
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(drop, _NEG_INF)
