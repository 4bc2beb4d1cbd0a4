"""A draft model: a smaller model with the target's tokenizer drafts greedily.

It runs in its own engine (the same engine code, its own KV cache and prefix cache) inside the
worker. Each round, every request that drafts becomes a short greedy request of the draft
engine over its tokens so far; the draft engine's prefix cache holds what earlier rounds
computed, so a round runs only the tokens since the last full cached block, then `k` greedy
steps for all requests at once. The drafts are the draft model's greedy tokens, so the
rejection sampler sees a one-hot draft distribution.
"""

from __future__ import annotations

import dataclasses

from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.engine import Engine
from nanoserve.core.request import Request

# On a GPU the target's engine takes `gpu_memory_utilization` of it; the draft's weights, KV
# cache and activations take up to this much more.
DRAFT_GPU_SHARE = 0.08


class DraftModelProposer:
    """Drafts with a smaller model run by its own engine."""

    can_peek = False  # it drafts as many as asked, sure or not

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def build(cls, target: EngineConfig, model: str, vocab_size: int, max_model_len: int):
        """The draft engine: the target's settings, the draft's weights, no speculation."""
        from nanoserve.engine_setup import build_engine  # the composition root builds engines

        config = dataclasses.replace(
            target,
            model=model,
            revision=None,
            max_model_len=max_model_len,
            speculative_config=None,
            enable_prefix_caching=True,
            tensor_parallel_size=1,
            gpu_memory_utilization=min(1.0, target.gpu_memory_utilization + DRAFT_GPU_SHARE),
        )
        engine = build_engine(config)
        if engine.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({engine.vocab_size} tokens) differs from the "
                f"target's ({vocab_size}); a draft model must share the target's tokenizer"
            )
        return cls(engine)

    def peek(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        raise NotImplementedError("a draft model cannot tell which of its drafts are sure")

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to `num_tokens[i]` greedy draft tokens for each request, all in one batch."""
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for request, count in zip(requests, num_tokens, strict=True):
            self.engine.add_request(
                request.request_id, request.all_token_ids, _draft_params(request, count)
            )
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                drafts[delta.request_id] += delta.new_token_ids
        return [drafts[r.request_id] for r in requests]

    def finish(self, request: Request) -> None:
        """Nothing to drop: each round's draft requests finish within the round."""

    def close(self) -> None:
        self.engine.shutdown()


def _draft_params(request: Request, num_tokens: int) -> SamplingParams:
    """Greedy, at most `num_tokens` long, with the target's bans and biases where they move the
    argmax: EOS and stop ids masked while min_tokens are not out, and logit_bias. A draft ends
    where the target would (EOS, a stop id)."""
    params = request.sampling_params
    return SamplingParams(
        temperature=0.0,
        max_tokens=num_tokens,
        min_tokens=min(num_tokens, max(0, params.min_tokens - request.num_output_tokens)),
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
        logit_bias=params.logit_bias,
    )
