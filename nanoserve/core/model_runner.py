"""The model runner: owns the model and its KV cache, turns a schedule into one forward pass.

Per step it flattens the scheduled tokens of every request into one batch (`step_layout.py`:
token ids, positions, the KV slot each token writes, the block table each request reads), runs
the model once, and samples from the logits of each request's last position, for the requests
whose prompt is complete after this step. Requests that ask for prompt logprobs also get the
logits of the prompt positions they ran (`prompt_logprobs.py`).

The fast paths are switched on here and nowhere else: the attention backend bound to every
layer (`attention/selector.py`), oneDNN-packed linear weights on CPU, CUDA graphs for decode
steps on CUDA (`cuda_graphs.py`, off with `enforce_eager`), and torch.compile for decode steps
on CPU (`compile_decode`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from nanoserve.common.config import CacheConfig, ModelConfig, SchedulerConfig
from nanoserve.common.protocol import TokenLogprobs
from nanoserve.core.attention.metadata import AttentionMetadata, build_attention_metadata
from nanoserve.core.kv_cache import KVCache
from nanoserve.core.models.llama import LlamaForCausalLM
from nanoserve.core.request import Request
from nanoserve.core.sampler import Sampler
from nanoserve.core.sampling_batch import SamplingBatch
from nanoserve.core.scheduler import SchedulerOutput
from nanoserve.core.step_layout import StepLayout, flatten_schedule
from nanoserve.distributed.parallel import TensorParallel
from nanoserve.distributed.step_broadcast import StepBroadcaster
from nanoserve.platforms.cpu.fused_ops import use_fused_cpu_ops
from nanoserve.platforms.cpu.linear import install_packed_linears
from nanoserve.platforms.cuda.cuda_graphs import CudaGraphRunner
from nanoserve.platforms.selector import select_attention_backend
from nanoserve.quantization.fp8 import can_use_fp8_matmul, install_fp8_linears
from nanoserve.quantization.int8 import install_int8_linears
from nanoserve.structured_output.manager import GrammarMasks

logger = logging.getLogger("nanoserve.model_runner")


@dataclass(frozen=True)
class QuantizationChoice:
    """Which quantized linear method to install: `--quantization`, or the checkpoint's FP8."""

    method: str | None  # "int8" or None
    include_lm_head: bool = True
    checkpoint_fp8: bool = False  # the checkpoint was FP8 (dequantized while loading)


def install_linear_methods(
    model: LlamaForCausalLM,
    device: torch.device,
    quantization: QuantizationChoice | None,
    compile_decode: bool,
) -> None:
    """int8 where asked; FP8 products for an FP8 checkpoint on an FP8 GPU; then, on CPU,
    oneDNN-packed weights for the linears still plain, and the fused norm and RoPE kernels."""
    if quantization is not None and quantization.method == "int8":
        install_int8_linears(model, include_lm_head=quantization.include_lm_head)
    elif quantization is not None and quantization.checkpoint_fp8 and can_use_fp8_matmul(device):
        install_fp8_linears(model)
    if device.type == "cpu":
        # The compiled one-token products stream the plain weights: keep them too.
        install_packed_linears(model, keep_plain_weights=compile_decode)
        use_fused_cpu_ops()  # RMSNorm and RoPE in one pass each, in eager steps


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
        enforce_eager: bool = False,
        quantization: QuantizationChoice | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        self.model = model
        self.tp = tp or TensorParallel()
        # Rank 0 schedules; with tensor parallelism it sends each step to the other ranks.
        self.broadcaster = StepBroadcaster(self.tp, device) if self.tp.size > 1 else None
        self.device = device
        self.vocab_size = model_config.vocab_size
        self.block_size = cache_config.block_size
        self.sampler = Sampler()
        install_linear_methods(model, device, quantization, compile_decode)
        self.attention_backend = select_attention_backend(
            device,
            self.block_size,
            model.attention_layers()[0].num_kv_heads,  # this rank's
            compile_decode=compile_decode,
            enforce_eager=enforce_eager,
        )
        # Compiled steps: see docs/architecture.md, "The compiled decode path".
        self.compiled_model: Callable[..., torch.Tensor] | None = None
        self.compiled_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        if compile_decode and device.type == "cpu":
            self.compiled_model = torch.compile(model, dynamic=True)
            self.compiled_logits = torch.compile(model.compute_logits, dynamic=True)
        self.kv_cache = KVCache(
            model, model_config, self.attention_backend, self.block_size, device, self.tp
        )
        self.kv_cache.allocate(cache_config, scheduler_config)
        self.graph_runner: CudaGraphRunner | None = None
        self.graph_capture_time_s = 0.0
        if device.type == "cuda" and self.attention_backend.name == "triton" and not enforce_eager:
            self.graph_runner = CudaGraphRunner(
                model,
                scheduler_config.max_num_seqs,
                scheduler_config.max_model_len,
                self.block_size,
                device,
            )
            self.graph_capture_time_s = self.graph_runner.capture()

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def kv_block_bytes(self) -> int:
        return self.kv_cache.block_bytes

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        eos_token_ids: frozenset[int],
        start_masks: Callable[[list[Request]], Future[GrammarMasks] | None] = lambda _: None,
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs], dict[str, list[TokenLogprobs]]]:
        """Run the scheduled tokens; return per request the sampled token, its logprobs and
        the logprobs of the prompt positions scored in this step.

        Every host-to-device copy (inputs, sampling parameters) is made before the forward pass
        is launched, so that the only wait on the device is for the sampled tokens.
        `start_masks` starts the grammar masks of the sampling rows; they are computed while
        the forward pass runs and applied before sampling.
        """
        layout = flatten_schedule(out, self.block_size)
        requests = layout.sampling_requests
        pending_masks = start_masks(requests)
        batch = SamplingBatch.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[r.generator for r in requests],
            vocab_size=self.vocab_size,
            device=self.device,
            eos_token_ids=eos_token_ids,
        )
        if self.broadcaster is not None:
            self.broadcaster.send(layout)
        hidden = self.forward(layout)  # [S + P, hidden]: the rows that sample, then score
        prompt_logprobs = {}
        if layout.prompt_logprob_rows.rows:
            prompt_logprobs = layout.prompt_logprob_rows.compute(
                hidden[len(requests) :], self.logits, self.vocab_size
            )
        if not requests:
            return {}, {}, prompt_logprobs
        logits = self.logits(hidden[: len(requests)])  # [S, hidden] -> [S, vocab] float32
        batch.grammar_masks = pending_masks.result() if pending_masks is not None else None
        result = self.sampler(logits, batch)
        token_ids = {r.request_id: t for r, t in zip(requests, result.token_ids, strict=True)}
        logprobs = {
            r.request_id: lp
            for r, lp in zip(requests, result.logprobs, strict=True)
            if lp is not None
        }
        return token_ids, logprobs, prompt_logprobs

    def forward(self, layout: StepLayout) -> torch.Tensor:  # [S + P, hidden]
        """Hidden states of the rows that sample, then of those that score prompt tokens: a
        CUDA graph, a compiled step or eager.

        The model finishes only those rows (a prompt's last token, prompt positions to score),
        unless that is every row in order (decode-only steps, which keeps compiled and captured
        graphs simple).
        """
        graphs = self.graph_runner
        if graphs is not None and layout.is_decode_only and graphs.can_run(len(layout.query_lens)):
            hidden = graphs.run(layout.decode_inputs())  # [T, hidden]
            return hidden if layout.is_every_row_output else hidden[layout.output_rows]
        model: Callable[..., torch.Tensor] = self.model
        if self.compiled_model is not None and layout.is_decode_only:
            model = self.compiled_model
        output_rows = None
        if not layout.is_every_row_output:
            output_rows = self._tensor(layout.output_rows)
        input_ids, positions = self._tensor(layout.input_ids), self._tensor(layout.positions)
        return model(input_ids, positions, self.attention_metadata(layout), output_rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        compute_logits = self.compiled_logits or self.model.compute_logits
        return compute_logits(hidden)

    def follow(self) -> None:
        """A rank other than 0: run each step rank 0 broadcasts, until it says stop."""
        assert self.broadcaster is not None and not self.tp.is_first
        with torch.inference_mode():
            while (layout := self.broadcaster.receive()) is not None:
                hidden = self.forward(layout)
                num_sampled = len(layout.sample_rows)
                for begin, end in layout.prompt_logprob_rows.logit_slices(self.vocab_size):
                    self.logits(hidden[num_sampled + begin : num_sampled + end])  # rank 0's gathers
                if num_sampled:
                    self.logits(hidden[:num_sampled])  # this rank's share of the gathered logits

    def stop_followers(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.send_stop()

    def attention_metadata(self, layout: StepLayout) -> AttentionMetadata:
        return build_attention_metadata(
            layout.query_lens,
            layout.seq_lens,
            layout.block_tables,
            layout.slot_mapping,
            self.block_size,
            self.device,
            eager_fields=self.attention_backend.uses_eager_metadata,
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
