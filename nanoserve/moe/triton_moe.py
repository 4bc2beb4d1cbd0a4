"""TritonMoeMethod: the experts of a step on a GPU in two Triton kernels, as vLLM's fused MoE.

    decode steps (up to PAIRWISE_MAX_TOKENS tokens, and every step a CUDA graph captures):
        `expert_pair_gemv`, one program per
        (token, chosen expert) pair and block of output rows; the expert id is read on the
        device, so the step has fixed shapes and no host sync (a CUDA graph can hold it), and
        only the chosen experts' rows are read
    longer steps: `grouped_gemm`, the (token, expert) pairs sorted by expert (`routing.py`), one
        program per block of BLOCK_M pairs of one expert and block of output rows, the token
        rows gathered inside the kernel, `tl.dot` over K

Both run twice per layer (gate/up, then down); silu(gate) * up is the layer's op between them
and the weighted sum over a token's experts is done in float32 after the second. The tests run
the kernels on CPU under TRITON_INTERPRET=1 against the grouped PyTorch method.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.moe.layer import MoeMethod, SparseMoeBlock, combine

PAIRWISE_MAX_TOKENS = 16  # decode batches up to this size take the pairwise GEMV
BLOCK_N, BLOCK_K, BLOCK_M = 64, 64, 16


@triton.jit
def expert_pair_gemv(
    a_ptr,  # [R, K]: input rows
    w_ptr,  # [E, N, K]: stacked experts
    expert_ptr,  # [P] int64: each pair's local expert (-1: not on this rank)
    out_ptr,  # [P, N]
    N,
    K,
    pairs_per_row,  # pair p reads input row p // pairs_per_row
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output rows
    expert = tl.load(expert_ptr + pair)
    row = pair // pairs_per_row
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if expert >= 0:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
            w_offsets = expert * N * K + cols[:, None] * K + ks[None, :]
            w_mask = (cols[:, None] < N) & (ks[None, :] < K)
            w = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)  # [BLOCK_N]
    tl.store(out_ptr + pair * N + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def grouped_gemm(
    a_ptr,  # [R, K]: input rows
    row_ptr,  # [A] int64: the input row of each (sorted) pair
    w_ptr,  # [E, N, K]
    block_expert_ptr,  # [B] int64: the expert of each block of pairs
    block_start_ptr,  # [B] int64: its first pair
    block_end_ptr,  # [B] int64: one past its last pair
    out_ptr,  # [A, N]
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    start, end = tl.load(block_start_ptr + block), tl.load(block_end_ptr + block)
    pairs = start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    is_pair = pairs < end
    rows = tl.load(row_ptr + pairs, mask=is_pair, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a_mask = is_pair[:, None] & (ks[None, :] < K)
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=a_mask, other=0.0)
        w_offsets = expert * N * K + cols[None, :] * K + ks[:, None]  # [BLOCK_K, BLOCK_N]
        w_mask = (cols[None, :] < N) & (ks[:, None] < K)
        w = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0)
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    out_mask = is_pair[:, None] & (cols[None, :] < N)
    tl.store(
        out_ptr + pairs[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), out_mask
    )


def pair_products(a: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, per_row: int):
    """[P, N]: pair p's input row (p // per_row of `a` [R, K]) times its expert of `w`."""
    num_pairs, (_, n, k) = experts.numel(), w.shape
    out = a.new_empty(num_pairs, n)
    grid = (num_pairs, triton.cdiv(n, BLOCK_N))
    expert_pair_gemv[grid](a, w, experts, out, n, k, per_row, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def grouped_products(a, rows, w, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """[A, N]: pair i's input row (`rows[i]` of `a`) times its expert, pairs grouped by expert
    (`spans`: expert, first pair, end)."""
    blocks = [
        (expert, begin, min(begin + BLOCK_M, end))
        for expert, start, end in spans
        for begin in range(start, end, BLOCK_M)
    ]
    num_pairs, (_, n, k) = rows.numel(), w.shape
    out = a.new_empty(num_pairs, n)
    if not blocks:
        return out
    expert_of, start, end = torch.tensor(blocks, device=a.device).T.contiguous()
    grid = (len(blocks), triton.cdiv(n, BLOCK_N))
    grouped_gemm[grid](
        a,
        rows,
        w,
        expert_of,
        start,
        end,
        out,
        n,
        k,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out


def is_capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured: its steps must take the fixed-shape path."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class TritonMoeMethod(MoeMethod):
    """The experts through the Triton kernels (the model's weights as loaded, any float dtype)."""

    def apply(self, layer: SparseMoeBlock, x, weights, expert_ids) -> torch.Tensor:
        x = x.contiguous()
        num_tokens, top_k = expert_ids.shape
        if num_tokens <= PAIRWISE_MAX_TOKENS or is_capturing(x.device):
            local = expert_ids - layer.shard.first  # [T, k]
            is_local = (local >= 0) & (local < layer.shard.count)
            experts = torch.where(is_local, local, -1).flatten()  # [T * k]
            gate_up = pair_products(x, layer.w13, experts, top_k)  # [T * k, 2I]
            down = pair_products(layer.ops.silu_mul(gate_up), layer.w2, experts, 1)  # [T*k, H]
            weighted = down.float() * (weights * is_local).reshape(-1, 1)
            return weighted.view(num_tokens, top_k, -1).sum(1).to(x.dtype)  # [T, H]
        groups = layer.group(weights, expert_ids)
        spans = groups.spans()
        gate_up = grouped_products(x, groups.token_index, layer.w13, spans)  # [A, 2I]
        act = layer.ops.silu_mul(gate_up).contiguous()  # [A, I]
        identity = torch.arange(act.shape[0], device=x.device)
        return combine(x, groups, grouped_products(act, identity, layer.w2, spans))
