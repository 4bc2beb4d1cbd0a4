"""The default CPU attention backend: the reference backend, with decode tokens (and the tokens
of steps whose every request runs only a few) attending through our compiled paged-decode
kernel (`csrc/decode_attention.cpp`, see `kernels.py`).

The reference path gathers every decode request's keys and values out of the paged cache, pads
them to the longest context and runs PyTorch's ops over the copies: at a decode step's sizes
that costs more in copies and dispatch than in arithmetic. The kernel reads each key and value
row where it lies in the cache, once for all the query heads that share it, in float32 (an FP8
cache's rows widened as they are read). Every step's new keys and values go into the cache
through the kernels' `store_kv` (a byte copy per token: `index_copy_`'s set-up costs more than
the copy at a decode step's sizes, and it is slower at a long prompt's too).

A short prompt chunk after a long cached prefix (an editor's next keystroke: a few new tokens
over a whole document) is the same shape as a few decode tokens: each of its tokens attends over
the context up to its own position. Where every request of a step runs at most
`SHORT_CHUNK_TOKENS` tokens, each token goes through the kernel as if it were a decode token,
with its request's block table and its own context length; no context is gathered. In bf16,
where the prompt kernel is built, the kernel finds a request's tokens in a row and attends them
as one chunk, on the prompt kernel's tiles, reading the context once, not once a token (so are
a verify step's drafts, laid out the same way): there chunks of up to `RUN_CHUNK_TOKENS` take
this way. So do longer chunks while the step's (token, key) pairs are few
(`TOKEN_BY_TOKEN_PAIRS`: a short prompt with little or nothing cached, the first request of a
chat): without runs the kernel computes each token's scores alone, a dot product per key,
which costs more per pair than SDPA's blocks but little at such sizes. Such steps can run fused
(`fused_decode.py`). Where a step was sent this way for its runs alone and the kernel cannot
attend runs on this cache (an FP8 pool), it attends as the reference backend does. Other chunks
attend as in the reference backend: over the gathered context, through our prompt kernel
(`csrc/prompt_attention.cpp`: flash attention whose two products run on AMX's tile units, or on
AVX-512 BF16's pair dot products where there are no tiles) where the CPU has either and the
chunk is bf16, else through SDPA's flash kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from nanoserve.core.attention.reference import (
    ReferenceAttention,
    ReferenceMetadata,
    decode_group_attention,
)

if TYPE_CHECKING:
    from nanoserve.core.step_layout import StepLayout

KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# Up to this many tokens per request, a step's tokens attend one by one through the kernel;
SHORT_CHUNK_TOKENS = 16
# up to this many where the kernel attends a request's tokens in a row as one chunk. Measured on
# the Qwen3-0.6B shape: 17 to 100 new tokens over a cached 1,500-token document answered
# 15-20 ms sooner than through the gathered context; a cold 96- or 128-token prompt ~7% sooner.
# (The prompt kernel's row tiles hold 128 queries.)
RUN_CHUNK_TOKENS = 128
# longer chunks too, where the step's tokens see this many keys in all, or fewer. Measured on
# the Qwen3-0.6B shape, a step so attended (and fused) beat the eager one up to ~6k pairs
# (~10 ms fewer at a cold 46- or 64-token prompt) and lost past ~8k.
TOKEN_BY_TOKEN_PAIRS = 4096


@dataclass
class CpuKernelMetadata(ReferenceMetadata):
    """The reference metadata plus, where every request of the step runs at most
    `SHORT_CHUNK_TOKENS` tokens, each token as a decode query: its request's block table
    ([T, max_blocks]) and the context it sees ([T]), built once per step for every layer."""

    token_contexts: tuple[torch.Tensor, torch.Tensor] | None = None
    # Sent token by token only because the kernel attends its chunks' tokens in a row as runs.
    needs_runs: bool = False


class CpuKernelAttention(ReferenceAttention):
    """Reference attention whose decode tokens, and short chunks, take the paged-decode kernel,
    and whose longer bf16 prompt chunks take the prompt kernel where the CPU has bf16 products."""

    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        self.prompt_kernel = kernels.prompt_attention_is_available()  # and so runs as chunks

    def build_metadata(
        self, layout: StepLayout, block_size: int, device: torch.device
    ) -> CpuKernelMetadata:
        meta = super().build_metadata(layout, block_size, device)
        return with_token_contexts(meta, layout, self.prompt_kernel)

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
        contexts = token_contexts(meta)
        if contexts is None or q.dtype not in KERNEL_DTYPES or q.device.type != "cpu":
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        runs_needed = isinstance(meta, CpuKernelMetadata) and meta.needs_runs
        if runs_needed and not self.kernels.paged_chunk_attention_takes(q, k_cache):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, *contexts, scale)

    def store_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        """What `write_kv` does, as a byte copy per token through the kernels (see above),
        for decode tokens and prompt chunks alike."""
        if k.device.type != "cpu" or not all(has_token_rows(t) for t in (k, v)):
            return super().store_kv(k, v, k_cache, v_cache, slot_mapping)
        self.kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend_decodes(
        self,
        query: torch.Tensor,  # [B, H, D]: one query token per request
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: ReferenceMetadata,
        scale: float,
    ) -> torch.Tensor:  # [B, H, D]
        if query.dtype not in KERNEL_DTYPES or query.device.type != "cpu":
            return decode_group_attention(query, k_cache, v_cache, meta, scale)
        return self.kernels.paged_decode_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale
        )

    def attend_chunk(
        self,
        query: torch.Tensor,  # [Q, H, D]
        key: torch.Tensor,  # [K, Hkv, D]
        value: torch.Tensor,  # [K, Hkv, D]
        mask: torch.Tensor | None,  # [Q, K], causal aligned to the last key; None: Q == K
        scale: float,
    ) -> torch.Tensor:  # [Q, H, D]
        if self.prompt_kernel and takes_kernel_chunk(query, key, value):
            return self.kernels.prompt_attention(query, key, value, scale)
        return super().attend_chunk(query, key, value, mask, scale)


def takes_kernel_chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the prompt kernel takes these: bf16 CPU tensors, head dims a multiple of 32,
    each token's heads contiguous (a view into a fused qkv output is fine)."""
    tensors = (query, key, value)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return False
    return query.shape[-1] % 32 == 0 and all(has_token_rows(t) for t in tensors)


def has_token_rows(x: torch.Tensor) -> bool:
    """Whether each token's heads of [T, H, D] `x` are contiguous (its tokens may be apart)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def per_token_contexts(meta: ReferenceMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token of the step as a decode token: its request's block table ([T, max_blocks])
    and the context it sees ([T]: every key up to and including its own position)."""
    query_lens = torch.tensor(meta.query_lens_list, device=meta.seq_lens.device)
    request_of_token = torch.repeat_interleave(query_lens)  # [T]: 0, 0, 0, 1, 2, 2, ...
    first_token = meta.query_start_loc.to(query_lens.device)[request_of_token]  # [T]
    index_in_chunk = torch.arange(len(request_of_token), device=query_lens.device) - first_token
    first_position = meta.seq_lens - query_lens  # [B]: cached tokens before this step's
    seq_lens = first_position[request_of_token] + index_in_chunk + 1  # [T]
    return meta.block_tables.index_select(0, request_of_token), seq_lens


def attends_token_by_token(layout: StepLayout, chunk_runs: bool = False) -> bool:
    """Whether a step attends through the kernel, each token as a decode query: decode steps,
    steps of short chunks (longer ones where the kernel attends `chunk_runs`), and steps whose
    tokens see few keys in all (see above)."""
    if max(layout.query_lens) <= short_chunk_tokens(chunk_runs):
        return True
    # A chunk of q tokens ending at context s: its tokens see s - q + 1, ..., s keys.
    chunks = zip(layout.query_lens, layout.seq_lens, strict=True)
    pairs = sum(q * s - q * (q - 1) // 2 for q, s in chunks)
    return pairs <= TOKEN_BY_TOKEN_PAIRS


def short_chunk_tokens(chunk_runs: bool) -> int:
    """The most tokens a request may run for its step to attend token by token regardless of
    its context."""
    return RUN_CHUNK_TOKENS if chunk_runs else SHORT_CHUNK_TOKENS


def with_token_contexts(
    meta: ReferenceMetadata, layout: StepLayout, chunk_runs: bool = False
) -> CpuKernelMetadata:
    """`meta` with its tokens' contexts where the step attends token by token (see above)."""
    fields = {field.name: getattr(meta, field.name) for field in dataclasses.fields(meta)}
    cpu_meta = CpuKernelMetadata(**fields)
    if not meta.is_decode_only and attends_token_by_token(layout, chunk_runs):
        cpu_meta.token_contexts = per_token_contexts(meta)
        cpu_meta.needs_runs = not attends_token_by_token(layout)
    return cpu_meta


def token_contexts(meta: ReferenceMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(block tables, context lengths) of the step's tokens as decode queries, or None where
    its prompt chunks attend as in the reference backend."""
    if meta.is_decode_only:
        return meta.block_tables, meta.seq_lens  # one token per request: the requests' own
    return meta.token_contexts if isinstance(meta, CpuKernelMetadata) else None
