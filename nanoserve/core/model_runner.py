"""The model runner: turns a schedule into one forward pass, and samples.

Per step it flattens the scheduled tokens of every request into one batch (`step_layout.py`),
runs the model once through the first of its step runners that can run the step, and samples
from the last position of each request whose prompt is complete; requests that ask for prompt
logprobs also get those of the prompt positions they ran (`prompt_logprobs.py`).

A step runner is one way of launching the forward pass. The eager one here runs any step: the
attention backend's metadata for it, then the model. Fast ones (a CUDA graph replay, a compiled
decode step) say which steps they take and go before it (`FastPaths.step_runners`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from nanoserve.common.protocol import TokenLogprobs
from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.core.grammar import GrammarMasks
from nanoserve.core.models.base import CausalLM
from nanoserve.core.request import Request
from nanoserve.core.sampler import Sampler
from nanoserve.core.sampling_batch import SamplingBatch
from nanoserve.core.scheduler import SchedulerOutput
from nanoserve.core.speculation import Verified
from nanoserve.core.step_layout import StepLayout, flatten_schedule


class StepAbandoned(Exception):
    """A runner stopped a step whose requests were all aborted while it ran: what it wrote
    lies past their computed tokens, in blocks their aborts return."""


class StepRunner:
    """One way of launching a step's forward pass; `can_run` says which steps it takes."""

    name = "abstract"

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    def can_run(self, layout: StepLayout) -> bool:
        return True

    def run(self, layout: StepLayout) -> torch.Tensor:  # [S + P, hidden]
        """Hidden states of the rows that sample, then of those that score prompt tokens."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        return self.model.compute_logits(hidden)

    def close(self) -> None:
        """Release what the runner holds (the engine is shutting down)."""


class EagerStepRunner(StepRunner):
    """Runs any step: the backend's metadata for it, then the model, op by op.

    The model finishes only the output rows (a prompt's last token, prompt positions to score)
    unless that is every row in order, as in decode-only steps.
    """

    name = "eager"

    def __init__(
        self, model: CausalLM, backend: AttentionBackend, block_size: int, device: torch.device
    ) -> None:
        super().__init__(model)
        self.backend = backend
        self.block_size = block_size
        self.device = device

    def run(self, layout: StepLayout) -> torch.Tensor:  # [S + P, hidden]
        return self.run_model(self.model, layout)

    def run_model(self, model: Callable[..., torch.Tensor], layout: StepLayout) -> torch.Tensor:
        """`model` (the plain one, or a compiled copy) over this step's flat batch."""
        output_rows = None
        if not layout.is_every_row_output:
            output_rows = self._tensor(layout.output_rows)  # [S + P]
        meta = self.backend.build_metadata(layout, self.block_size, self.device)
        input_ids, positions = self._tensor(layout.input_ids), self._tensor(layout.positions)
        return model(input_ids, positions, meta, output_rows)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


class ModelRunner:
    """Runs the model over the paged KV cache and samples the next tokens."""

    def __init__(
        self,
        step_runners: list[StepRunner],
        vocab_size: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        assert step_runners, "the eager runner, at least, runs every step"
        self.step_runners = step_runners
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()

    def runner_for(self, layout: StepLayout) -> StepRunner:
        """The first step runner that can run this step."""
        return next(r for r in self.step_runners if r.can_run(layout))

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        eos_token_ids: frozenset[int],
        start_masks: Callable[[list[Request], list[list[int]]], Future[GrammarMasks] | None] = (
            lambda requests, drafts: None
        ),
        verify: Callable[[torch.Tensor, SamplingBatch, list[list[int]]], Verified] | None = None,
        are_aborted: Callable[[list[str]], bool] | None = None,
    ) -> tuple[
        dict[str, list[int]], dict[str, list[TokenLogprobs]], dict[str, list[TokenLogprobs]]
    ]:
        """Run the scheduled tokens; return per request the sampled tokens (one, or with drafts
        the accepted ones and one more, as `verify` decides), their logprobs and the logprobs
        of the prompt positions scored in this step.

        Every host-to-device copy (inputs, sampling parameters) is made before the forward pass
        is launched, so that the only wait on the device is for the sampled tokens.
        `start_masks` starts the grammar masks of the sampling rows; they are computed while
        the forward pass runs and applied before sampling.
        """
        layout = flatten_schedule(out, self.block_size, are_aborted)
        requests, drafts = layout.sampling_requests, layout.draft_token_ids
        pending_masks = start_masks(requests, drafts)
        # One row per position that samples: per request its last token, then each draft.
        rows = [
            (r, d[:j]) for r, d in zip(requests, drafts, strict=True) for j in range(len(d) + 1)
        ]
        batch = SamplingBatch.build(
            params=[r.sampling_params for r, _ in rows],
            prompt_token_ids=[r.prompt_token_ids for r, _ in rows],
            output_token_ids=[
                r.output_token_ids + seen if seen else r.output_token_ids for r, seen in rows
            ],
            generators=[r.generator for r, _ in rows],
            vocab_size=self.vocab_size,
            device=self.device,
            eos_token_ids=eos_token_ids,
        )
        runner = self.runner_for(layout)
        hidden = runner.run(layout)  # [S + D + P, hidden]: the rows that sample, then score
        num_sample_rows = len(rows)
        prompt_logprobs = {}
        if layout.prompt_logprob_rows.rows:
            prompt_logprobs = layout.prompt_logprob_rows.compute(
                hidden[num_sample_rows:], runner.logits, self.vocab_size
            )
        if not requests:
            return {}, {}, prompt_logprobs
        logits = runner.logits(hidden[:num_sample_rows])  # [S + D, vocab] float32
        batch.grammar_masks = pending_masks.result() if pending_masks is not None else None
        if verify is not None and num_sample_rows > len(requests):
            token_ids, logprobs = verify(logits, batch, drafts)
        else:
            result = self.sampler(logits, batch)
            token_ids = [[t] for t in result.token_ids]
            logprobs = [None if lp is None else [lp] for lp in result.logprobs]
        ids = [r.request_id for r in requests]
        chosen = dict(zip(ids, token_ids, strict=True))
        return chosen, {i: lp for i, lp in zip(ids, logprobs, strict=True) if lp}, prompt_logprobs

    def close(self) -> None:
        for runner in self.step_runners:
            runner.close()
