"""Prompt logprobs: how likely the model found each prompt token, computed as the prompt runs.

Position j's logits predict token j + 1, so a prompt of N tokens has N - 1 scored tokens; the
first has none (vLLM and OpenAI report None for it). In a step that runs positions
[start, end) of a prompt, every position not scored yet and before the last prompt token
(whose logits pick the first generated token) gives the logprob, the rank and the top-k of the
prompt token after it, from the raw logits like the sampler's logprobs. A chunked prompt is
scored chunk by chunk; the request keeps the results until its first delta takes them.

A prompt position needs its logits, so it must run: a request that still needs prompt logprobs
takes no more from the prefix cache than the positions it has already scored
(`Request.max_cached_prefix_tokens`). Its blocks are still cached for other requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoserve.common.protocol import TokenLogprobs
from nanoserve.core.request import Request
from nanoserve.core.sampler import gather_token_logprobs

# Logits are made for at most this many floats at once (128 MiB in float32), so that a long
# prompt chunk over a large vocabulary (e.g. 2,048 tokens x 151,936) is scored in slices.
MAX_LOGITS_ELEMENTS = 1 << 25


@dataclass
class PromptLogprobRows:
    """The rows of one step's flat batch whose logits score prompt tokens."""

    rows: list[int] = field(default_factory=list)  # [P]: flat index in the step's batch
    target_ids: list[int] = field(default_factory=list)  # [P]: the prompt token each row scores
    num_top: list[int] = field(default_factory=list)  # [P]: top alternatives wanted
    num_rows_by_request: dict[str, int] = field(default_factory=dict)  # in row order

    def add(self, request: Request, start: int, end: int, first_row: int) -> None:
        """Positions [start, end) of `request` run this step, from flat row `first_row` on."""
        if not request.needs_prompt_logprobs:
            return
        first = request.num_scored_prompt_tokens  # positions before it are scored
        assert start <= first, "a prompt position to score was taken from the prefix cache"
        last = min(end, request.num_prompt_tokens - 1)
        if first >= last:
            return
        num_rows = last - first
        self.rows.extend(range(first_row + first - start, first_row + last - start))
        self.target_ids.extend(request.prompt_token_ids[first + 1 : last + 1])
        self.num_top.extend([request.sampling_params.prompt_logprobs or 0] * num_rows)
        self.num_rows_by_request[request.request_id] = num_rows

    def logit_slices(self, vocab_size: int) -> list[tuple[int, int]]:
        """The [begin, end) row ranges whose logits are made at once (a bounded amount)."""
        slice_rows = max(1, MAX_LOGITS_ELEMENTS // vocab_size)
        return [
            (begin, min(begin + slice_rows, len(self.rows)))
            for begin in range(0, len(self.rows), slice_rows)
        ]

    def compute(
        self,
        hidden: torch.Tensor,  # [P, hidden]: the last layer's output at `rows`
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        vocab_size: int,
    ) -> dict[str, list[TokenLogprobs]]:
        """The scored positions of each request, in position order."""
        target_ids = torch.tensor(self.target_ids, dtype=torch.int64, device=hidden.device)
        entries: list[TokenLogprobs] = []
        for begin, end in self.logit_slices(vocab_size):
            logprobs = compute_logits(hidden[begin:end]).log_softmax(dim=-1)  # [p, V] float32
            entries += gather_token_logprobs(
                logprobs, target_ids[begin:end], self.num_top[begin:end]
            )
        result, begin = {}, 0
        for request_id, num_rows in self.num_rows_by_request.items():
            result[request_id] = entries[begin : begin + num_rows]
            begin += num_rows
        return result
