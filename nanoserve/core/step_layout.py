"""One step's flat batch, on the host: which tokens run, where their keys go, what is sampled.

The runner flattens the scheduled tokens of every request into one sequence, one-token
(decode) requests first so that attention can treat them apart from prompt chunks. The lists
become device tensors for an eager forward pass (each attention backend builds its metadata
from them), or go straight into a CUDA graph's buffers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from nanoserve.core.prompt_logprobs import PromptLogprobRows
from nanoserve.core.request import Request
from nanoserve.core.scheduler import SchedulerOutput


@dataclass
class StepLayout:
    """The flat batch of one step as Python lists (T tokens, B requests, S sampled)."""

    input_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    slot_mapping: list[int] = field(default_factory=list)  # [T]: block_id * block_size + offset
    # [B] attention sequences: a request each, or with drafts one per token
    query_lens: list[int] = field(default_factory=list)  # [B]
    seq_lens: list[int] = field(default_factory=list)  # [B]: context length after this step
    block_tables: list[list[int]] = field(default_factory=list)  # [B]
    # [S + D]: each sampling request's last known row, then one row per draft token after it
    sample_rows: list[int] = field(default_factory=list)
    sampling_requests: list[Request] = field(default_factory=list)  # [S]
    draft_token_ids: list[list[int]] = field(default_factory=list)  # [S]: drafts to verify
    prompt_logprob_rows: PromptLogprobRows = field(default_factory=PromptLogprobRows)  # [P]
    # Asked by a runner that can stop part-way: were all the step's requests aborted meanwhile?
    is_abandoned: Callable[[], bool] = lambda: False

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @property
    def output_rows(self) -> list[int]:
        """[S + P]: the rows the model finishes: those that sample, then those that score."""
        return self.sample_rows + self.prompt_logprob_rows.rows

    @property
    def is_every_row_output(self) -> bool:
        """Every row, in order, is output (decode-only steps): no selection is needed."""
        return len(self.sample_rows) == len(self.input_ids) and not self.prompt_logprob_rows.rows


def flatten_schedule(
    out: SchedulerOutput, block_size: int, are_aborted: Callable[[list[str]], bool] | None = None
) -> StepLayout:
    """Lay out the scheduled tokens of all requests as one batch, decodes first.

    A decode with drafts is laid out as one attention sequence per token, each a decode of one
    query over the context up to it (same block table): every decode path (the paged-decode
    kernels, CUDA graphs) then verifies drafts as it decodes. `are_aborted(request_ids)` (the
    worker's inbox) answers the layout's `is_abandoned`.
    """
    num_tokens, drafted = out.num_scheduled_tokens, out.draft_token_ids
    layout = StepLayout()
    if are_aborted is not None:
        layout.is_abandoned = partial(are_aborted, [r.request_id for r in out.requests])

    def is_chunk(request: Request) -> bool:  # a prompt chunk, not a decode (with drafts or not)
        return num_tokens[request.request_id] - len(drafted.get(request.request_id, ())) > 1

    for request in sorted(out.requests, key=is_chunk):
        start = request.num_computed_tokens
        end = start + num_tokens[request.request_id]
        blocks = request.block_ids
        drafts = drafted.get(request.request_id, [])
        layout.prompt_logprob_rows.add(request, start, end, first_row=len(layout.input_ids))
        layout.input_ids.extend(request.all_token_ids[start : end - len(drafts)] + drafts)
        layout.positions.extend(range(start, end))
        layout.slot_mapping.extend(
            blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        num_sequences = 1 + len(drafts)  # drafts: one single-query sequence per token
        layout.query_lens.extend([(end - start) // num_sequences] * num_sequences)
        layout.seq_lens.extend(range(end - num_sequences + 1, end + 1))
        layout.block_tables.extend([blocks] * num_sequences)
        # The whole known sequence is cached after this step: sample the next token (and,
        # behind each draft, the one after it).
        if end - len(drafts) == request.num_tokens and not request.is_prompt_only:
            last_row = len(layout.input_ids) - 1
            layout.sample_rows.extend(range(last_row - len(drafts), last_row + 1))
            layout.sampling_requests.append(request)
            layout.draft_token_ids.append(drafts)
    return layout
