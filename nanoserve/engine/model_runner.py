"""The model runner: owns the model and the KV pool, turns a schedule into one forward pass.

Per step it flattens the scheduled tokens of every request into one batch (token ids,
positions, the KV slot each token writes, the block table each request reads), runs the model
once, and samples from the logits of each request's last position, for the requests whose
prompt is complete after this step.

The fast paths are switched on here and nowhere else: the attention backend bound to every
layer, oneDNN-packed linear weights on CPU, and (`compile_decode`) torch.compile for steps where
every request runs one token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from nanoserve.config import CacheConfig, ModelConfig, SchedulerConfig
from nanoserve.engine.attention.cpu import CompiledCpuAttention
from nanoserve.engine.attention.eager import EagerAttention
from nanoserve.engine.attention.layer import AttentionBackend
from nanoserve.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from nanoserve.engine.cpu_linear import install_packed_linears
from nanoserve.engine.models.llama import LlamaForCausalLM
from nanoserve.engine.request import Request
from nanoserve.engine.sampler import Sampler
from nanoserve.engine.sampling_batch import SamplingBatch
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.structured.manager import GrammarMasks
from nanoserve.protocol import TokenLogprobs

logger = logging.getLogger("nanoserve.model_runner")

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


@dataclass
class StepInputs:
    """One step's flat batch, ready for the model."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S]: flat index of the last token of each request that samples
    sampling_requests: list[Request]  # [S]


def select_attention_backend(device: torch.device, compile_decode: bool) -> AttentionBackend:
    """The one attention backend of this engine, for every layer."""
    if compile_decode and device.type == "cpu":
        return CompiledCpuAttention()
    return EagerAttention()


class ModelRunner:
    """Runs the model over the paged KV cache and samples the next tokens."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        compile_decode: bool = False,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.block_size = cache_config.block_size
        self.sampler = Sampler()
        if device.type == "cpu":
            # The compiled one-token products stream the plain weights: keep them too.
            install_packed_linears(model, keep_plain_weights=compile_decode)
        self.attention_backend = select_attention_backend(device, compile_decode)
        # Compiled steps: see docs/architecture.md, "The compiled decode path".
        self.compiled_model: Callable[..., torch.Tensor] | None = None
        self.compiled_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        if compile_decode:
            self.compiled_model = torch.compile(model, dynamic=True)
            self.compiled_logits = torch.compile(model.compute_logits, dynamic=True)
        self.num_blocks = self._num_kv_blocks(cache_config, scheduler_config)
        self.kv_cache = self._allocate_kv_cache(self.num_blocks)

    # -- KV cache ---------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block across all layers: K and V, block_size slots, every KV head."""
        cfg = self.model_config
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        return per_token * self.block_size * torch.finfo(self.dtype).bits // 8

    def _num_kv_blocks(self, cache_config: CacheConfig, limits: SchedulerConfig) -> int:
        if cache_config.num_blocks_override is not None:
            return cache_config.num_blocks_override
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget(
                cache_config.gpu_memory_utilization, limits.max_num_batched_tokens
            )
        else:
            budget = cache_config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
            if cache_config.kv_cache_memory is None:
                # Without an explicit budget, take no more than every sequence at full length.
                needed_tokens = (
                    limits.max_num_seqs * limits.max_model_len + limits.max_num_batched_tokens
                )
                budget = min(budget, (needed_tokens // self.block_size + 1) * self.kv_block_bytes)
        num_blocks = budget // self.kv_block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds fewer than 2 blocks of "
                f"{self.block_size} tokens; give more kv_cache_memory (or gpu_memory_utilization)"
            )
        return num_blocks

    def _cuda_kv_budget(self, utilization: float, max_num_batched_tokens: int) -> int:
        """GPU memory left for KV after weights and a full-size forward's activations."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward(max_num_batched_tokens)
        peak = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        return max(0, int(total * utilization) - peak)

    def _profile_forward(self, num_tokens: int) -> None:
        """Run the model once on `num_tokens` tokens with a throwaway cache to find peak memory."""
        cfg = self.model_config
        num_blocks = -(-num_tokens // self.block_size)
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        for layer in self.model.attention_layers():
            k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.bind(k_cache, torch.zeros_like(k_cache), self.attention_backend)
        meta = build_attention_metadata(
            [num_tokens],
            [num_tokens],
            [list(range(num_blocks))],
            list(range(num_tokens)),
            self.block_size,
            self.device,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device), meta)
            self.model.compute_logits(hidden[-1:])
        for layer in self.model.attention_layers():
            layer.bind(None, None, self.attention_backend)
        torch.cuda.synchronize(self.device)

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, a K and a V tensor [num_blocks, block_size, Hkv, D], bound to its layer.

        Separate tensors rather than views of one: torch.compile updates a cache in place only
        when it aliases no other input. Zero-filled so that slots not yet written hold finite
        values (they are masked, but 0 * NaN would still poison the attention output).
        """
        cfg = self.model_config
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        kv_cache = []
        for layer in self.model.attention_layers():
            k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            # Fixed shapes: keeps torch.compile from tying a cache dim to an equal batch size.
            torch._dynamo.mark_static(k_cache)
            torch._dynamo.mark_static(v_cache)
            layer.bind(k_cache, v_cache, self.attention_backend)
            kv_cache.append((k_cache, v_cache))
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), up to %d tokens",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_block_bytes / 2**20,
            num_blocks * self.block_size,
        )
        return kv_cache

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        eos_token_ids: frozenset[int],
        start_masks: Callable[[list[Request]], Future[GrammarMasks] | None] = lambda _: None,
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Run the scheduled tokens; return the sampled token (and logprobs) per request.

        `start_masks` starts the grammar masks of the sampling rows; they are computed while
        the forward pass runs and applied before sampling.
        """
        inputs = self.prepare_inputs(out)
        pending_masks = start_masks(inputs.sampling_requests)
        model: Callable[..., torch.Tensor] = self.model
        compute_logits: Callable[[torch.Tensor], torch.Tensor] = self.model.compute_logits
        if self.compiled_model is not None and inputs.attn_meta.is_decode_only:
            model = self.compiled_model
        if self.compiled_logits is not None:
            compute_logits = self.compiled_logits  # only the sampled rows, whatever the step
        # The model finishes only the rows we sample from (a prompt's last token), unless
        # every row is sampled (decode-only steps, which keeps the compiled graph simple).
        every_row_sampled = len(inputs.sampling_requests) == inputs.input_ids.shape[0]
        output_rows = None if every_row_sampled else inputs.sample_rows
        hidden = model(inputs.input_ids, inputs.positions, inputs.attn_meta, output_rows)
        if not inputs.sampling_requests:
            return {}, {}
        logits = compute_logits(hidden)  # [S, hidden] -> [S, vocab] float32
        requests = inputs.sampling_requests
        batch = SamplingBatch.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[r.generator for r in requests],
            vocab_size=logits.shape[-1],
            device=self.device,
            eos_token_ids=eos_token_ids,
        )
        batch.grammar_masks = pending_masks.result() if pending_masks is not None else None
        result = self.sampler(logits, batch)
        token_ids = {r.request_id: t for r, t in zip(requests, result.token_ids, strict=True)}
        logprobs = {
            r.request_id: lp
            for r, lp in zip(requests, result.logprobs, strict=True)
            if lp is not None
        }
        return token_ids, logprobs

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled tokens of all requests into one batch, decodes first.

        Putting one-token requests first lets attention handle them apart from prompt chunks.
        """
        block_size = self.block_size
        num_tokens = out.num_scheduled_tokens
        requests = sorted(out.requests, key=lambda r: num_tokens[r.request_id] > 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens, seq_lens, block_tables = [], [], []
        sample_rows: list[int] = []
        sampling_requests: list[Request] = []
        for request in requests:
            start = request.num_computed_tokens
            end = start + out.num_scheduled_tokens[request.request_id]
            blocks = request.block_ids
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(
                blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
            )
            query_lens.append(end - start)
            seq_lens.append(end)
            block_tables.append(blocks)
            if end == request.num_tokens:  # the whole known sequence is cached: sample next
                sample_rows.append(len(input_ids) - 1)
                sampling_requests.append(request)
        attn_meta = build_attention_metadata(
            query_lens, seq_lens, block_tables, slot_mapping, block_size, self.device
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attn_meta=attn_meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            sampling_requests=sampling_requests,
        )
