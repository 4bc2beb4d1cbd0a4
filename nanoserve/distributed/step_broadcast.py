"""Rank 0 tells the other ranks what each step runs: the step's layout, broadcast as one tensor.

Only rank 0 schedules. Per step it packs the flat batch (`StepLayout`: token ids, positions,
KV slots, per-request lengths and block tables, the rows that sample) into one int64 tensor and
broadcasts it, after a 5-number header with its sizes; the other ranks unpack it and run the same
forward pass on their shards (`follow`). A header of -1 tells them to stop.

On rank 0 this enters the core as a step runner (`BroadcastingRunner`): it sends each step's
layout, then lets the runners it wraps (CUDA graphs, eager) run the step.
"""

from __future__ import annotations

import torch

from nanoserve.core.model_runner import ModelRunner, StepRunner
from nanoserve.core.parallel import TensorParallel
from nanoserve.core.step_layout import StepLayout

HEADER_SIZE = 5  # tokens, requests, sampled rows, block-table width, prompt-scoring rows
STOP = -1


def pack(layout: StepLayout) -> torch.Tensor:  # [header + payload] int64
    """One step's layout as a flat int64 tensor (block tables padded with -1)."""
    width = max((len(t) for t in layout.block_tables), default=0)
    tables = [t + [-1] * (width - len(t)) for t in layout.block_tables]
    prompt_rows = layout.prompt_logprob_rows.rows
    num_tokens, num_requests = len(layout.input_ids), len(layout.query_lens)
    header = [num_tokens, num_requests, len(layout.sample_rows), width, len(prompt_rows)]
    payload = [*layout.input_ids, *layout.positions, *layout.slot_mapping]  # [3T]
    payload += [*layout.query_lens, *layout.seq_lens]  # [2B]
    payload += [block for table in tables for block in table]  # [B * width]
    payload += [*layout.sample_rows, *prompt_rows]  # [S + P]
    return torch.tensor(header + payload, dtype=torch.int64)


def unpack(packed: torch.Tensor) -> StepLayout:
    """The layout `pack` made (without the requests themselves: followers do not sample)."""
    values = packed.tolist()
    num_tokens, num_requests, num_sampled, width, num_prompt_rows = values[:HEADER_SIZE]
    position = HEADER_SIZE

    def take(count: int) -> list[int]:
        nonlocal position
        chunk = values[position : position + count]
        position += count
        return chunk

    layout = StepLayout(input_ids=take(num_tokens), positions=take(num_tokens))
    layout.slot_mapping = take(num_tokens)
    layout.query_lens, layout.seq_lens = take(num_requests), take(num_requests)
    flat_tables = take(num_requests * width)
    layout.block_tables = [
        [b for b in flat_tables[i * width : (i + 1) * width] if b >= 0] for i in range(num_requests)
    ]
    layout.sample_rows = take(num_sampled)
    layout.prompt_logprob_rows.rows = take(num_prompt_rows)
    return layout


class StepBroadcaster:
    """Sends (rank 0) or receives (the others) each step's layout over the group's CPU link."""

    def __init__(self, tp: TensorParallel, device: torch.device) -> None:
        self.tp = tp
        self.device = device  # NCCL broadcasts device tensors; gloo, CPU ones

    def send(self, layout: StepLayout) -> None:
        packed = pack(layout)
        self._broadcast(packed[:HEADER_SIZE].clone())
        self._broadcast(packed[HEADER_SIZE:].clone())

    def send_stop(self) -> None:
        self._broadcast(torch.full((HEADER_SIZE,), STOP, dtype=torch.int64))

    def receive(self) -> StepLayout | None:
        """The next step's layout, or None when rank 0 says stop."""
        header = self._broadcast(torch.empty(HEADER_SIZE, dtype=torch.int64))
        num_tokens, num_requests, num_sampled, width, num_prompt_rows = header.tolist()
        if num_tokens == STOP:
            return None
        size = 3 * num_tokens + 2 * num_requests + num_requests * width + num_sampled
        size += num_prompt_rows
        payload = self._broadcast(torch.empty(size, dtype=torch.int64))
        return unpack(torch.cat([header, payload]))

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        on_device = tensor.to(self.device)
        torch.distributed.broadcast(on_device, src=self.tp.first_global_rank, group=self.tp.group)
        return on_device.cpu()


class BroadcastingRunner(StepRunner):
    """Rank 0's step runner: sends each step to the other ranks, then runs it with the first
    of `runners` that can (the same runners the other ranks run it with)."""

    name = "tp-broadcast"

    def __init__(self, runners: list[StepRunner], broadcaster: StepBroadcaster) -> None:
        super().__init__(runners[-1].model)
        self.runners = runners
        self.broadcaster = broadcaster
        self._current = runners[-1]  # the runner of the step in flight (its logits too)
        self.name = "tp-broadcast(" + ", ".join(r.name for r in runners) + ")"

    def run(self, layout: StepLayout) -> torch.Tensor:  # [S + P, hidden]
        self.broadcaster.send(layout)
        self._current = next(r for r in self.runners if r.can_run(layout))
        return self._current.run(layout)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._current.logits(hidden)

    def close(self) -> None:
        """The other ranks stop following (rank 0 is leaving)."""
        self.broadcaster.send_stop()
        for runner in self.runners:
            runner.close()


def follow(runner: ModelRunner, broadcaster: StepBroadcaster) -> None:
    """A rank other than 0: run each step rank 0 broadcasts, until it says stop.

    The logits are computed as rank 0 computes them, in the same order (prompt positions, then
    the sampled rows): each call takes part in rank 0's gather of the vocabulary shards.
    """
    with torch.inference_mode():
        while (layout := broadcaster.receive()) is not None:
            step_runner = runner.runner_for(layout)
            hidden = step_runner.run(layout)
            num_sampled = len(layout.sample_rows)
            for begin, end in layout.prompt_logprob_rows.logit_slices(runner.vocab_size):
                step_runner.logits(hidden[num_sampled + begin : num_sampled + end])
            if num_sampled:
                step_runner.logits(hidden[:num_sampled])
