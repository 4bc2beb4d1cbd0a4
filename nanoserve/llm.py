"""LLM: offline batch generation over the in-process engine, in vLLM's shape.

from nanoserve import LLM, SamplingParams
llm = LLM(model="path/to/checkpoint")
outputs = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import RequestDelta
from nanoserve.engine.request import FinishReason
from nanoserve.outputs import CompletionOutput, Logprob, RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import IncrementalDetokenizer, load_tokenizer

PromptType = str | list[int]


class LLM:
    """Generate completions for many prompts at once with continuous batching."""

    def __init__(self, model: str, tokenizer: str | None = None, **engine_args) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = load_tokenizer(tokenizer or str(self.engine.model_path))
        self._request_counter = itertools.count()

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; "
                "give one, or one per prompt"
            )

        results: list[RequestOutput] = []
        pending: dict[str, _Completion] = {}
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                text, token_ids = self._tokenize(prompt)
                result = RequestOutput(str(next(self._request_counter)), text, token_ids)
                results.append(result)
                for index in range(params.n):
                    child = _child_params(params, index)
                    request_id = f"{result.request_id}-{index}"
                    self.engine.add_request(request_id, token_ids, child)
                    detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, child)
                    pending[request_id] = _Completion(result, index, detokenizer)
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    self._apply(delta, pending)
        finally:
            self.engine.abort(list(pending))
        for result in results:
            result.outputs.sort(key=lambda o: o.index)
        return results

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, list(prompt)

    def _apply(self, delta: RequestDelta, pending: dict[str, _Completion]) -> None:
        completion = pending[delta.request_id]
        completion.token_ids.extend(delta.new_token_ids)
        if delta.logprobs is not None:
            completion.add_logprobs(delta, self.tokenizer)
        completion.detokenizer.update(delta.new_token_ids)
        finish_reason = delta.finish_reason
        stop_reason: int | str | None = delta.stop_reason
        if completion.detokenizer.stop_reason is not None:
            self.engine.abort([delta.request_id])
            finish_reason, stop_reason = FinishReason.STOP, completion.detokenizer.stop_reason
        if finish_reason is None:
            return
        del pending[delta.request_id]
        completion.detokenizer.flush()
        completion.result.num_cached_tokens = delta.num_cached_tokens
        completion.result.outputs.append(
            CompletionOutput(
                index=completion.index,
                text=completion.detokenizer.output_text,
                token_ids=completion.token_ids,
                finish_reason=str(FinishReason(finish_reason)),
                stop_reason=stop_reason,
                logprobs=completion.logprobs,
            )
        )


class _Completion:
    """One running completion's accumulated state while `generate` runs."""

    def __init__(self, result: RequestOutput, index: int, detokenizer: IncrementalDetokenizer):
        self.result = result
        self.index = index
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = None

    def add_logprobs(self, delta: RequestDelta, tokenizer) -> None:
        self.logprobs = self.logprobs or []
        for entry in delta.logprobs:
            position = {
                token_id: Logprob(logprob, rank, tokenizer.decode([token_id]))
                for rank, (token_id, logprob) in enumerate(
                    zip(entry.top_token_ids, entry.top_logprobs, strict=True), start=1
                )
            }
            position[entry.token_id] = Logprob(
                entry.logprob, entry.rank, tokenizer.decode([entry.token_id])
            )
            self.logprobs.append(position)


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n completions of one prompt differ: a seeded request gives child i the seed + i."""
    if params.n == 1 and params.seed is None:
        return params
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


def _as_prompt_list(prompts: PromptType | list[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list")
    return prompts
