"""The engine: requests in, one step at a time, new tokens out. Token ids only, never text."""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from nanoserve.common.checkpoint import load_generation_config_eos
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import EngineStats, RequestDelta, TokenLogprobs
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core import loader
from nanoserve.core.kv_cache_manager import KVCacheManager
from nanoserve.core.model_runner import ModelRunner, QuantizationChoice
from nanoserve.core.request import Request
from nanoserve.core.sampling_batch import seeded_generator
from nanoserve.core.scheduler import Scheduler
from nanoserve.distributed.parallel import TensorParallel
from nanoserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("nanoserve.core")


class Engine:
    """Loads a model, owns the scheduler and model runner, and runs engine steps."""

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        self.config = config
        started = time.perf_counter()
        self.device = loader.resolve_device(config.device)
        torch.manual_seed(config.seed)
        model, self.model_config, self.model_path = loader.load_model(config, self.device, tp=tp)
        self.dtype = next(model.parameters()).dtype
        self.load_time_s = time.perf_counter() - started

        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        self.eos_token_ids = frozenset(
            set(self.model_config.eos_token_ids) | load_generation_config_eos(self.model_path)
        )
        started = time.perf_counter()
        self.runner = ModelRunner(
            model,
            self.model_config,
            config.cache_config(),
            config.scheduler_config(self.max_model_len),
            self.device,
            compile_decode=config.use_compiled_decode,
            enforce_eager=config.enforce_eager,
            quantization=QuantizationChoice(
                config.quantization,
                include_lm_head=config.quantize_lm_head,
                checkpoint_fp8=self.model_config.quantization is not None,
            ),
            tp=tp,
        )
        self.kv_sizing_time_s = time.perf_counter() - started
        self._fit_max_model_len_to_kv_cache()
        kv_manager = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), kv_manager)
        self.structured = StructuredOutputManager(
            self.model_path, self.vocab_size, self.eos_token_ids
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.runner.block_size

    def _fit_max_model_len_to_kv_cache(self) -> None:
        """One sequence of max_model_len tokens must fit in the KV cache.

        If the user chose max_model_len, a cache too small for it is an error; if it came from
        the model (e.g. Qwen3's 40,960 positions against the 2 GiB CPU default), lower it.
        """
        capacity = self.kv_capacity_tokens
        if capacity >= self.max_model_len:
            return
        budget_mib = self.runner.num_blocks * self.runner.kv_block_bytes / 2**20
        if self.config.max_model_len is not None:
            raise ValueError(
                f"the KV cache ({budget_mib:.1f} MiB) holds {capacity} tokens, fewer than "
                f"max_model_len ({self.max_model_len}); give more kv_cache_memory (or "
                "gpu_memory_utilization) or lower max_model_len"
            )
        logger.warning(
            "max_model_len lowered from %d (the model's) to %d, what the KV cache (%.1f MiB) "
            "holds; pass --kv-cache-memory (or --gpu-memory-utilization) for more, or "
            "--max-model-len to choose",
            self.max_model_len,
            capacity,
            budget_mib,
        )
        self.max_model_len = capacity

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises ValueError for a prompt the model cannot take."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {num_prompt} input tokens; leave room for at least one "
                "output token."
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        params.validate_for_vocab(self.vocab_size)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time)
        if params.seed is not None:
            request.generator = seeded_generator(params.seed, self.device)
        if params.structured_outputs is not None:
            request.grammar_future = self.structured.compile(params.structured_outputs)
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests in any state; every block they held is returned."""
        self.scheduler.abort(request_ids)

    def step(self) -> list[RequestDelta]:
        """Schedule, execute, update: one forward pass over the running batch."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            self._wait_for_a_grammar()
            return []
        token_ids: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if scheduled.requests:
            token_ids, logprobs, prompt_logprobs = self.runner.execute(
                scheduled, self.eos_token_ids, self.structured.start_masks
            )
        return self.scheduler.update(scheduled, token_ids, logprobs, prompt_logprobs)

    def _wait_for_a_grammar(self) -> None:
        """Nothing could run: if requests wait for their grammar, block briefly on those."""
        pending = [r.grammar_future for r in self.scheduler.waiting if r.grammar_future]
        if pending:
            wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)

    def warm_up(self) -> None:
        """Prefill, then decode steps at batch sizes 1 and 2 before serving.

        Lazy initialisation happens here instead of inside the first users' requests. With
        `compile_decode` the decode steps also cross from a one-block context into a second
        block: torch.compile specializes sizes 1 apart from larger ones, both of the batch and
        of the block-table width, so the four graphs the first requests need (and that every
        larger batch and context reuses) are compiled before Ready.
        """
        num_tokens = 2
        if self.config.use_compiled_decode:
            num_tokens = min(self.runner.block_size + 2, self.max_model_len - 2)
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        for request_ids in (["warmup-0"], ["warmup-1", "warmup-2"]):
            for index, request_id in enumerate(request_ids):
                self.add_request(request_id, [1 + index, 2 + index], params)
            while self.has_unfinished_requests():
                self.step()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage(),
            num_kv_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries=kv.num_prefix_queries,
            prefix_cache_hits=kv.num_prefix_hits,
        )
