"""Sampler: turns each request's last-position logits into its next token, for the whole batch.

Each step the model runner builds one `SamplingBatch` (per-request parameters as per-row
tensors) and calls `Sampler()(logits, batch)`. One vectorised pass, in this order:

    raw logits ─▶ logprobs: log_softmax of the raw logits (vLLM's default "raw_logprobs")
        │
        ▼  penalties (they move the argmax)
    logit_bias → repetition penalty (prompt + output tokens) → presence/frequency penalties
    (output tokens) → min_tokens (EOS and stop ids at -inf) → grammar masks (tokens a
    structured-output grammar forbids at -inf)                      ─▶ greedy rows: argmax here
        │
        ▼  warpers (they keep the argmax; they only shape the distribution)
    temperature → top-k → top-p → min-p ─▶ softmax ─▶ a token drawn by inverse transform

The warper order is transformers' (`generate`) and vLLM v0's; vLLM v1 applies min-p before
top-k/top-p, which gives a different result only when min-p and top-k/top-p are combined.

A random row draws one uniform u and takes the first token whose running sum of p passes u:
token i with probability p_i (one number per row, where the Gumbel-max trick, argmax(p / E)
with E ~ Exp(1), draws one per token: on CPU the larger cost of a step). A seeded request
draws u from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.common.protocol import TokenLogprobs
from nanoserve.core.grammar import apply_grammar_masks
from nanoserve.core.sampling_batch import SamplingBatch

_NEG_INF = float("-inf")


class SamplerOps:
    """The sampler's two passes over whole rows, in PyTorch (a platform's kernels may replace
    them: `FastPaths.sampler_ops`)."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
        """Each row's argmax: the first of ties, a NaN above every number."""
        return x.max(dim=-1).indices

    def draw(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:  # -> [B]
        """probs [B, V], uniforms [B] in [0, 1): per row the first token whose running sum of
        probabilities (in float64) passes `uniforms` times the row's sum."""
        sums = probs.double().cumsum(dim=-1)  # [B, V]
        token = torch.searchsorted(sums, uniforms.unsqueeze(1) * sums[:, -1:], right=True)
        return token[:, 0].clamp_(max=probs.shape[1] - 1)  # [B]


@dataclass
class SamplerOutput:
    """The next token of every request in the batch, and its logprobs where asked for."""

    token_ids: list[int]  # [B]
    logprobs: list[TokenLogprobs | None]  # [B]; None where params.logprobs is None


class Sampler:
    """Picks the next token of every request in one vectorised pass (see the module docstring)."""

    ops = SamplerOps()  # the platform's (`FastPaths.sampler_ops`) where it has kernels

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
        if batch.grammar_masks is not None:
            logits = apply_grammar_masks(logits, batch.grammar_masks)
        if batch.all_greedy:
            token_ids = self.ops.argmax(logits)  # [B]
        else:
            probs = self.apply_warpers(logits, batch).softmax(dim=-1)  # [B, V]
            token_ids = self.ops.draw(probs, self.uniforms(batch, probs.device))  # [B]
            if batch.is_greedy is not None:
                token_ids = torch.where(batch.is_greedy, self.ops.argmax(logits), token_ids)

        if raw_logprobs is None:
            return SamplerOutput(
                token_ids=to_host(token_ids)[0].tolist(), logprobs=[None] * batch.num_reqs
            )
        return self._with_logprobs(raw_logprobs, token_ids, batch)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits random rows sample from: penalties then warpers, -inf where filtered."""
        logits = self.apply_penalties(logits, batch)
        if batch.grammar_masks is not None:
            logits = apply_grammar_masks(logits.clone(), batch.grammar_masks)
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
        if batch.repetition_penalty is not None and batch.seen_mask is not None:
            # As in the CTRL paper and transformers: a seen token's logit moves towards zero
            # if positive, away from zero if negative, so the penalty always lowers it.
            penalty = batch.repetition_penalty  # [B, 1]
            penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
            logits = torch.where(batch.seen_mask, penalised, logits)
        if batch.output_counts is not None:
            # OpenAI: logit -= frequency * count + presence * (count > 0)
            counts = batch.output_counts  # [B, V]
            frequency, presence = batch.frequency_penalty, batch.presence_penalty  # [B, 1] each
            assert frequency is not None and presence is not None
            logits -= frequency * counts + presence * (counts > 0)
        if batch.banned is not None:
            logits[batch.banned] = _NEG_INF
        return logits

    @staticmethod
    def apply_warpers(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """temperature → top-k → top-p → min-p; each filter keeps at least the top token."""
        assert batch.temperature is not None, "warpers run only when some row is random"
        logits = logits / batch.temperature  # [B, V]
        if batch.top_k is not None:
            logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
        if batch.top_p_threshold is not None:
            logits = apply_top_p(logits, batch.top_p_threshold)
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        return logits

    @staticmethod
    def uniforms(batch: SamplingBatch, device: torch.device) -> torch.Tensor:  # [B] float64
        """One U(0, 1) per row; seeded rows draw theirs from their request's generator."""
        uniforms = torch.rand(batch.num_reqs, dtype=torch.float64, device=device)
        for row, generator in batch.seeded_rows:
            uniforms[row] = torch.rand((), dtype=torch.float64, device=device, generator=generator)
        return uniforms

    @staticmethod
    def _with_logprobs(
        raw_logprobs: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
    ) -> SamplerOutput:
        """The sampled tokens and, for the R rows that asked, their logprobs and the top ones."""
        # raw_logprobs: [R, V] for the R rows in batch.logprob_rows
        chosen_ids = token_ids[batch.logprob_index]  # [R]
        tensors = token_logprob_tensors(raw_logprobs, chosen_ids, batch.num_logprobs)
        tokens, *host = to_host(token_ids, *tensors)
        logprobs: list[TokenLogprobs | None] = [None] * batch.num_reqs
        for row, entry in zip(
            batch.logprob_rows, token_logprob_entries(host, batch.num_logprobs), strict=True
        ):
            logprobs[row] = entry
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copy tensors to the CPU with one wait on the device (the step's only host sync)."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    copies = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return copies


def token_logprob_tensors(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> tuple[torch.Tensor, ...]:
    """Per row: `token_ids[row]`, its logprob and rank, and the best `max(num_top)` tokens.

    logprobs: [R, V] log-softmax rows; token_ids: [R] long. Used for sampled tokens and for
    prompt tokens alike; `token_logprob_entries` turns the host copies into entries.
    """
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [R]
    # [R]; 1 = the most likely token (an int32 sum of the bools is ~40% faster on CPU)
    ranks = (logprobs >= chosen.unsqueeze(1)).sum(dim=-1, dtype=torch.int32)
    top_values, top_ids = logprobs.topk(max(num_top, default=0), dim=-1)  # [R, K]
    return token_ids, chosen, ranks, top_ids, top_values


def token_logprob_entries(host: list[torch.Tensor], num_top: list[int]) -> list[TokenLogprobs]:
    """`token_logprob_tensors`' results, copied to the CPU, as one entry per row."""
    columns = [t.tolist() for t in host]
    return [
        TokenLogprobs(token_id, logprob, rank, ids[:k], values[:k])
        for token_id, logprob, rank, ids, values, k in zip(*columns, num_top, strict=True)
    ]


def gather_token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """Logprob entries of `token_ids` in `logprobs` rows, with one wait on the device."""
    return token_logprob_entries(
        to_host(*token_logprob_tensors(logprobs, token_ids, num_top)), num_top
    )


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
