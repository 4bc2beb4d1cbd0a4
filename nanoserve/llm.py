"""LLM: offline batch generation over the in-process engine, in vLLM's shape.

from nanoserve import LLM, SamplingParams
llm = LLM()  # the demo model; or LLM(model="path/to/checkpoint"), LLM(model="Qwen/Qwen3-0.6B")
outputs = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools

from nanoserve.common.checkpoint import DEMO_MODEL_NAME, load_generation_defaults, resolve_tokenizer
from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.engine_setup import build_engine
from nanoserve.outputs import CompletionOutput, Logprob, RequestOutput
from nanoserve.text.output_processor import ChoiceState, OutputProcessor, PositionLogprobs
from nanoserve.text.tokenizer import load_tokenizer

PromptType = str | list[int]


class LLM:
    """Generate completions for many prompts at once with continuous batching.

    `generate` without sampling parameters uses `get_default_sampling_params()`: the model's
    generation_config.json defaults (`generation_config="auto"`, as vLLM) or ours ("vllm").
    """

    def __init__(
        self,
        model: str = DEMO_MODEL_NAME,
        tokenizer: str | None = None,
        generation_config: str = "auto",
        **engine_args,
    ) -> None:
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config: 'auto' or 'vllm', got {generation_config!r}")
        spec = engine_args.get("speculative_config")
        if isinstance(spec, dict):  # vLLM's LLM(speculative_config={...})
            engine_args["speculative_config"] = SpeculativeConfig.from_dict(spec)
        self.engine = build_engine(EngineConfig(model=model, **engine_args))
        download_dir = self.engine.config.download_dir
        tokenizer_dir = resolve_tokenizer(tokenizer, download_dir) if tokenizer else None
        self.tokenizer = load_tokenizer(tokenizer_dir or self.engine.model_path)
        self._request_counter = itertools.count()
        use_model = generation_config == "auto"
        self._defaults = load_generation_defaults(self.engine.model_path) if use_model else {}

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling parameters."""
        return SamplingParams(**self._defaults)

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompt_list))
        processor = OutputProcessor(self.tokenizer)
        results: list[RequestOutput] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                text, token_ids = self._tokenize(prompt)
                self._check(token_ids, params)
                result = RequestOutput(str(next(self._request_counter)), text, token_ids)
                results.append(result)
                for request in processor.add_request(result.request_id, token_ids, params):
                    self.engine.add_request(
                        request.request_id, request.prompt_token_ids, request.params
                    )
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.error is not None:  # e.g. a grammar that does not compile
                        raise ValueError(delta.error)
                    update = processor.process(delta)
                    if update is not None and update.needs_abort:
                        self.engine.abort([delta.request_id])
        finally:
            self.engine.abort(processor.unfinished_request_ids())
        by_id = {result.request_id: result for result in results}
        for choice in processor.sorted_choices():
            result = by_id[choice.request_id.rsplit("-", 1)[0]]
            result.num_cached_tokens = choice.num_cached_tokens
            if choice.prompt_logprobs is not None and result.prompt_logprobs is None:
                result.prompt_logprobs = [
                    None if p is None else _logprob_dict(p) for p in choice.prompt_logprobs
                ]
            result.outputs.append(_completion_output(choice))
        return results

    def _check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """What the engine trusts its front to have checked (ValueError names the problem)."""
        num_prompt, limit = len(prompt_token_ids), self.engine.max_model_len
        if num_prompt == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num_prompt >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {num_prompt} input tokens; leave room for at least one output token."
            )
        vocab_size = self.engine.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
        params.validate_for_vocab(vocab_size)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, list(prompt)


def _completion_output(choice: ChoiceState) -> CompletionOutput:
    return CompletionOutput(
        index=choice.index,  # each prompt is its own request here: choices count from 0
        text=choice.text,
        token_ids=choice.token_ids,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
        logprobs=[_logprob_dict(p) for p in choice.logprobs] if choice.wants_logprobs else None,
    )


def _logprob_dict(position: PositionLogprobs) -> dict[int, Logprob]:
    """vLLM's shape: token id -> Logprob, the top alternatives and the chosen token."""
    entries = {
        token_id: Logprob(logprob, rank, token)
        for rank, (token_id, token, logprob) in enumerate(position.top, start=1)
    }
    entries[position.token_id] = Logprob(position.logprob, position.rank, position.token)
    return entries


def _as_params_list(
    sampling_params: SamplingParams | list[SamplingParams], num_prompts: int
) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if len(sampling_params) != num_prompts:
        raise ValueError(
            f"got {len(sampling_params)} sampling params for {num_prompts} prompts; "
            "give one, or one per prompt"
        )
    return list(sampling_params)


def _as_prompt_list(prompts: PromptType | list[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]  # one prompt of token ids
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list")
    return prompts  # type: ignore[return-value]
