"""The rejection sampler: which drafts the target model accepts, keeping its distribution.

Every proposer here drafts deterministically (n-gram and suffix lookups, a draft model's greedy
tokens), so the draft distribution q is one-hot on the drafted token x. Speculative sampling
(Leviathan et al., Chen et al.) then reads, for each position with target probabilities p:

    accept x with probability min(1, p(x) / q(x)) = p(x)
    on rejection, sample from max(p - q, 0), normalised: p without x
    after the last accepted draft of a request that kept them all: one "bonus" token from p

which emits tokens distributed exactly as p. Greedy rows accept x when it is p's argmax and
otherwise emit the argmax, so greedy output is the same with and without speculation.

p is the distribution the plain sampler draws from: the same penalties (each row sees the
request's output plus the drafts before it), grammar masks and warpers (`core/sampler.py`).
A seeded request draws its uniforms and noise from its own generator, in row order.
"""

from __future__ import annotations

import torch

from nanoserve.common.protocol import TokenLogprobs
from nanoserve.core.sampler import Sampler, SamplerOps, gather_token_logprobs, to_host
from nanoserve.core.sampling_batch import SamplingBatch
from nanoserve.core.speculation import Verified


class RejectionSampler:
    """Verifies one step's drafts in one vectorised pass over every sampling row."""

    def __init__(self, ops: SamplerOps | None = None) -> None:
        self.sampler = Sampler()
        if ops is not None:  # the platform's, as the engine's sampler has
            self.sampler.ops = ops
        self.num_accepted: list[int] = []  # per request of the last call: drafts accepted

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, draft_token_ids: list[list[int]]
    ) -> Verified:
        # logits: [N, V] float32, N = requests + drafts; request r's rows are its last known
        # token then one per draft (`first_rows[r]` onwards).
        first_rows = _first_rows(draft_token_ids)
        # Per row, the draft its logits verify (-1 on a request's last row: the bonus).
        next_drafts = [t for drafts in draft_token_ids for t in [*drafts, -1]]  # [N]
        if batch.all_greedy:
            accepted_host, recovered_host = self._greedy_verdicts(logits, batch, next_drafts)
        else:
            accepted, recovered = self._accept_and_recover(logits, batch, next_drafts)
            accepted_host, recovered_host = (t.tolist() for t in to_host(accepted, recovered))
        token_ids: list[list[int]] = []
        emitted_rows: list[int] = []
        self.num_accepted = []
        for first, drafts in zip(first_rows, draft_token_ids, strict=True):
            num_accepted = 0
            while num_accepted < len(drafts) and accepted_host[first + num_accepted]:
                num_accepted += 1
            last_row = first + num_accepted  # rejected here, or the bonus row
            token_ids.append(drafts[:num_accepted] + [recovered_host[last_row]])
            emitted_rows.extend(range(first, last_row + 1))
            self.num_accepted.append(num_accepted)
        return token_ids, self._logprobs(logits, batch, first_rows, token_ids, emitted_rows)

    def _greedy_verdicts(
        self, logits: torch.Tensor, batch: SamplingBatch, next_drafts: list[int]
    ) -> tuple[list[bool], list[int]]:
        """`_accept_and_recover` where every row is greedy: a draft holds where it is the
        argmax, which is also the token emitted; compared on the host, the argmax the only
        tensor work (a verify step of a small model is a millisecond: a few ops count)."""
        argmax = self.sampler.ops.argmax(self.sampler.process_logits(logits, batch))  # [N]
        recovered = to_host(argmax)[0].tolist()
        return [d == a for d, a in zip(next_drafts, recovered, strict=True)], recovered

    def _accept_and_recover(
        self, logits: torch.Tensor, batch: SamplingBatch, next_drafts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: is its next draft accepted, and the token emitted if not (or the bonus);
        some rows random."""
        device = logits.device
        processed = self.sampler.process_logits(logits, batch)  # [N, V], -inf where filtered
        probs = processed.softmax(dim=-1)  # [N, V]
        draft_rows = [row for row, token in enumerate(next_drafts) if token >= 0]
        rows = torch.tensor(draft_rows, dtype=torch.long, device=device)  # [R]
        tokens = torch.tensor([next_drafts[r] for r in draft_rows], dtype=torch.long, device=device)
        accept_below, recover_at = uniform_pairs(batch, device)  # [N] each
        random_accepted = torch.zeros(len(next_drafts), dtype=torch.bool, device=device)  # [N]
        random_accepted[rows] = accept_below[rows] < probs[rows, tokens]
        # max(p - q, 0) with q one-hot on the draft: p with the draft token removed (the
        # draws take weights: no need to normalise).
        probs[rows, tokens] = 0.0
        recovered = self.sampler.ops.draw(probs, recover_at)
        if batch.is_greedy is None:  # no greedy row among random ones
            return random_accepted, recovered
        argmax = self.sampler.ops.argmax(processed)  # [N]
        drafted = torch.tensor(next_drafts, dtype=torch.long, device=device)  # [N]
        greedy_accepted = argmax == drafted  # (never on a bonus row: -1)
        return (
            torch.where(batch.is_greedy, greedy_accepted, random_accepted),
            torch.where(batch.is_greedy, argmax, recovered),
        )

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        batch: SamplingBatch,
        first_rows: list[int],
        token_ids: list[list[int]],
        emitted_rows: list[int],
    ) -> list[list[TokenLogprobs] | None]:
        """Raw logprobs of every emitted token, for the requests that asked for them."""
        wanted = set(batch.logprob_rows)
        result: list[list[TokenLogprobs] | None] = [None] * len(token_ids)
        rows = [row for row in emitted_rows if row in wanted]
        if not rows:
            return result
        emitted = dict(zip(emitted_rows, (t for ids in token_ids for t in ids), strict=True))
        num_top = [batch.num_logprobs[batch.logprob_rows.index(row)] for row in rows]
        index = torch.tensor(rows, device=logits.device)
        chosen = torch.tensor([emitted[row] for row in rows], device=logits.device)
        entries = iter(gather_token_logprobs(logits[index].log_softmax(-1), chosen, num_top))
        for request, (first, ids) in enumerate(zip(first_rows, token_ids, strict=True)):
            if first in wanted:
                result[request] = [next(entries) for _ in ids]
        return result


def uniform_pairs(batch: SamplingBatch, device: torch.device) -> torch.Tensor:  # [2, N]
    """Two U(0, 1) per row, float64: to accept its draft by, and to recover a token by. A seeded
    request's rows (in a row) draw theirs from its generator in one call, all its acceptance
    uniforms then all its recovery ones: the order of one draw per row and pass, in one call
    instead of two per row (each a few µs)."""
    uniforms = torch.rand(2, batch.num_reqs, dtype=torch.float64, device=device)
    runs: list[tuple[int, int, torch.Generator]] = []  # first row, rows, generator
    for row, generator in batch.seeded_rows:
        if runs and runs[-1][2] is generator and runs[-1][0] + runs[-1][1] == row:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, generator)
        else:
            runs.append((row, 1, generator))
    for first, count, generator in runs:
        uniforms[:, first : first + count] = torch.rand(
            2, count, dtype=torch.float64, device=device, generator=generator
        )
    return uniforms


def _first_rows(draft_token_ids: list[list[int]]) -> list[int]:
    """Each request's first sampling row: rows go request by request, 1 + drafts each."""
    first_rows, row = [], 0
    for drafts in draft_token_ids:
        first_rows.append(row)
        row += 1 + len(drafts)
    return first_rows
