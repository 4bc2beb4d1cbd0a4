"""The engine: requests in, one step at a time, new tokens out. Token ids only, never text."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from nanoserve.common.checkpoint import load_generation_config_eos
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import EngineStats, RequestDelta, TokenLogprobs
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core import loader
from nanoserve.core.fast_paths import FastPaths
from nanoserve.core.kv_cache import KVCache
from nanoserve.core.kv_cache_manager import KVCacheManager
from nanoserve.core.model_runner import EagerStepRunner, ModelRunner, StepAbandoned
from nanoserve.core.models.base import CausalLM
from nanoserve.core.parallel import TensorParallel
from nanoserve.core.request import Request
from nanoserve.core.sampling_batch import seeded_generator
from nanoserve.core.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger("nanoserve.engine")


class Engine:
    """Loads a model, owns the scheduler and model runner, and runs engine steps.

    `fast_paths` are what the platform and the plug-ins bring (`core/fast_paths.py`); without
    them the engine runs the portable reference path. The engine trusts its requests: the
    front (the server, or `LLM`) has checked them against the model's limits.
    """

    def __init__(
        self,
        config: EngineConfig,
        tp: TensorParallel | None = None,
        fast_paths: FastPaths | None = None,
    ) -> None:
        self.config = config
        self.tp = tp or TensorParallel()
        fast_paths = fast_paths or FastPaths()
        started = time.perf_counter()
        self.device = loader.resolve_device(config.device)
        torch.manual_seed(config.seed)
        model, self.model_config, self.model_path = loader.load_model(
            config, self.device, None, tp, fast_paths.weight_reader, fast_paths.model_classes
        )
        self.load_time_s = time.perf_counter() - started
        logger.info("weights in %.2f s; preparing the layers' linear methods", self.load_time_s)
        self.dtype = next(model.parameters()).dtype  # before the fast paths drop any weight
        fast_paths.prepare_model(model)  # linear methods and layer ops, layer by layer
        self.prepare_time_s = time.perf_counter() - started - self.load_time_s
        self.model = model

        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        self.eos_token_ids = frozenset(
            set(self.model_config.eos_token_ids) | load_generation_config_eos(self.model_path)
        )
        logger.info("layers prepared in %.2f s; sizing the KV cache", self.prepare_time_s)
        started = time.perf_counter()
        self.kv_cache, self.runner = self._build_runner(model, fast_paths, tp)
        self.kv_sizing_time_s = time.perf_counter() - started
        self._fit_max_model_len_to_kv_cache()
        kv_manager = KVCacheManager(
            self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), kv_manager)
        self.last_schedule: SchedulerOutput | None = None  # what the last step ran (timelines)
        self.grammars = fast_paths.grammar_backend(
            self.model_path, self.vocab_size, self.eos_token_ids
        )
        self.speculator = fast_paths.speculator(self.device, self.vocab_size, self.max_model_len)
        self.idle_work = fast_paths.idle_work  # the worker loop calls it while nothing runs

    def _build_runner(
        self, model: CausalLM, fast_paths: FastPaths, tp: TensorParallel | None
    ) -> tuple[KVCache, ModelRunner]:
        """The attention backend, the KV pool sized and bound to it, then the step runners
        (those that capture the model, as CUDA graphs do, need the pool in place)."""
        cache_config = self.config.cache_config()
        limits = self.config.scheduler_config(self.max_model_len)
        backend = fast_paths.attention_backend(model)
        layers = model.attention_layers()
        kv_cache = KVCache(
            layers,
            backend,
            cache_config.block_size,
            self.dtype,
            self.device,
            tp,
            fast_paths.kv_cache_zeros,
        )
        budget = None
        if fast_paths.kv_cache_budget is not None:
            budget = fast_paths.kv_cache_budget(model, kv_cache, cache_config, limits)
        kv_cache.allocate(cache_config, limits, budget)
        eager = EagerStepRunner(model, backend, cache_config.block_size, self.device)
        runners = fast_paths.step_runners(model, eager, limits)
        logger.info(
            "attention: %s; step runners: %s", backend.name, ", ".join(r.name for r in runners)
        )
        runner = ModelRunner(runners, self.vocab_size, cache_config.block_size, self.device)
        runner.sampler.ops = fast_paths.sampler_ops
        return kv_cache, runner

    def _fit_max_model_len_to_kv_cache(self) -> None:
        """One sequence of max_model_len tokens must fit in the KV cache.

        If the user chose max_model_len, a cache too small for it is an error; if it came from
        the model (e.g. Qwen3's 40,960 positions against the 2 GiB CPU default), lower it.
        """
        capacity = self.kv_cache.num_blocks * self.kv_cache.block_size
        if capacity >= self.max_model_len:
            return
        budget_mib = self.kv_cache.num_blocks * self.kv_cache.block_bytes / 2**20
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
        """Queue a checked request (see the class docstring); a grammar starts building now."""
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time)
        if params.seed is not None:
            request.generator = seeded_generator(params.seed, self.device)
        if params.structured_outputs is not None:
            request.grammar_future = self.grammars.compile(params.structured_outputs)
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests in any state; every block they held is returned."""
        self.scheduler.abort(request_ids)

    def step(self, are_aborted: Callable[[list[str]], bool] | None = None) -> list[RequestDelta]:
        """Schedule, execute, update: one forward pass over the running batch. A step runner
        may abandon a step whose requests all `are_aborted` meanwhile: nothing is updated.
        Drafts are proposed first, not after the last step: its tokens go out without that wait."""
        self.speculator.propose(self.scheduler.running)
        scheduled = self.last_schedule = self.scheduler.schedule()
        if scheduled.is_empty:
            self._wait_for_a_grammar()
            return []
        token_ids: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if scheduled.requests:
            try:
                token_ids, logprobs, prompt_logprobs = self.runner.execute(
                    scheduled,
                    self.eos_token_ids,
                    self.grammars.start_masks,
                    self.speculator.verify,
                    are_aborted,
                )
            except StepAbandoned:
                logger.debug("a step stopped part-way: its requests were aborted meanwhile")
                return []
        deltas = self.scheduler.update(scheduled, token_ids, logprobs, prompt_logprobs)
        return deltas

    def _wait_for_a_grammar(self) -> None:
        """Nothing could run: if requests wait for their grammar, block briefly on those."""
        pending = [r.grammar_future for r in self.scheduler.waiting if r.grammar_future]
        if pending:
            wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)

    def warm_up(self) -> None:
        """A prefill, then decode steps at batch sizes 1 and 2, before serving: lazy
        initialisation happens here instead of inside the first users' requests."""
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
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
            num_kv_blocks=self.kv_cache.num_blocks,
            block_size=self.kv_cache.block_size,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries=kv.num_prefix_queries,
            prefix_cache_hits=kv.num_prefix_hits,
            spec_decode=self.speculator.stats(),
        )

    def shutdown(self) -> None:
        """Release the step runners (other ranks stop following) and the grammar threads."""
        self.runner.close()
        self.grammars.shutdown()
        self.speculator.close()
