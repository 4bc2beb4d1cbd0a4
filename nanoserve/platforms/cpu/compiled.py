"""The compiled CPU decode path (`--compile`): decode steps run under torch.compile.

`CompiledDecodeRunner` is a step runner that takes decode-only steps (prefill and mixed steps go
to the eager runner: compiled, the per-request prompt attention splits each layer into pieces,
which measured slower). Its attention backend, `CompiledCpuAttention`, is the reference backend
except inside a compiled step: there the KV write is an opaque in-place custom op (traced as
`index_copy_` it would copy the whole cache), and the attention is written as gathers, products
and reductions that inductor fuses into a few loops.

`torch.compile(dynamic=True)` treats a size of 1 apart from larger ones, so a decode step has four
graphs: batch 1 or more, and a block table one block wide or wider. The runner compiles all four
when it is built, on steps of its own over the first two blocks of the (still empty) pool, so
that no user's request waits for a compile; every later batch and context reuses them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from nanoserve.core.attention.reference import ReferenceAttention, ReferenceMetadata, write_kv
from nanoserve.core.model_runner import EagerStepRunner, StepRunner
from nanoserve.core.step_layout import StepLayout

logger = logging.getLogger("nanoserve.compiled")


class CompiledCpuAttention(ReferenceAttention):
    """Reference attention, except inside a compiled decode step."""

    name = "cpu-compiled"

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: ReferenceMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        if not torch.compiler.is_compiling():
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        assert meta.is_decode_only, "only decode-only steps run compiled"
        torch.ops.nanoserve.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)


class CompiledDecodeRunner(StepRunner):
    """Decode-only steps through the torch.compile'd model and LM head."""

    name = "compiled-decode"

    def __init__(self, eager: EagerStepRunner) -> None:
        super().__init__(eager.model)
        self.eager = eager
        # The KV pool's shapes are fixed: keeps torch.compile from tying a cache dim to an equal
        # batch size (marked here, not when allocated: importing torch._dynamo takes a second).
        for layer in eager.model.attention_layers():
            torch._dynamo.mark_static(layer.k_cache)
            torch._dynamo.mark_static(layer.v_cache)
        self.compiled_model: Callable[..., torch.Tensor] = torch.compile(eager.model, dynamic=True)
        self.compiled_logits: Callable[[torch.Tensor], torch.Tensor] = torch.compile(
            eager.model.compute_logits, dynamic=True
        )

    def can_run(self, layout: StepLayout) -> bool:
        return layout.is_decode_only

    def run(self, layout: StepLayout) -> torch.Tensor:  # [B, hidden]
        return self.eager.run_model(self.compiled_model, layout)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, vocab]
        return self.compiled_logits(hidden)

    def compile_graphs(self) -> float:
        """Compile the four decode graphs (see the module docstring); seconds taken."""
        started = time.perf_counter()
        block_size = self.eager.block_size
        with torch.inference_mode():
            for num_requests in (1, 2):
                for num_blocks in (1, 2):
                    layout = warm_up_layout(num_requests, num_blocks, block_size)
                    self.logits(self.run(layout))
        elapsed = time.perf_counter() - started
        logger.info("compiled the decode step (4 graphs) in %.1f s", elapsed)
        return elapsed


def warm_up_layout(num_requests: int, num_blocks: int, block_size: int) -> StepLayout:
    """A decode step of `num_requests` over the pool's first `num_blocks` blocks, each request
    writing its token into the last slot of its context (a pool no request uses yet)."""
    context = (num_blocks - 1) * block_size + 1
    slot = context - 1
    return StepLayout(
        input_ids=[1] * num_requests,
        positions=[context - 1] * num_requests,
        slot_mapping=[slot] * num_requests,
        query_lens=[1] * num_requests,
        seq_lens=[context] * num_requests,
        block_tables=[list(range(num_blocks))] * num_requests,
        sample_rows=list(range(num_requests)),
    )


def decode_attention(
    query: torch.Tensor,  # [B, H, D]: one query token per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Attention of one new token per request, written for torch.compile to fuse.

    Same result as the reference backend on a decode-only batch, but as gathers, products and
    reductions that inductor turns into a few loops (no padding indexes, no bf16 batched
    matmuls, which are slow on CPU at these shapes).
    """
    num_requests, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_context = block_tables.shape[1] * block_size
    shape = (num_requests, max_context, num_kv_heads, 1, head_dim)
    k = k_cache[block_tables].view(shape).float()  # [B, K, Hkv, 1, D]
    v = v_cache[block_tables].view(shape).float()  # [B, K, Hkv, 1, D]
    q = query.float().view(num_requests, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = (q * k).sum(-1) * scale  # [B, K, Hkv, group]
    key_positions = torch.arange(max_context, device=query.device)  # [K]
    is_visible = key_positions[None, :] < seq_lens[:, None]  # [B, K]
    scores = scores.masked_fill(~is_visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)  # over the keys
    out = (probs[..., None] * v).sum(1)  # [B, Hkv, group, D]
    return out.reshape(num_requests, num_heads, head_dim).to(query.dtype)


@torch.library.custom_op("nanoserve::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    write_kv(k, v, k_cache, v_cache, slot_mapping)
