"""The default CPU attention backend: decode tokens through the C++ paged-decode kernel."""

from __future__ import annotations

import pytest
import torch

from nanoserve.common.config import EngineConfig
from nanoserve.core.attention.reference import (
    ReferenceAttention,
    build_reference_metadata,
    decode_group_attention,
    write_kv,
)
from nanoserve.core.step_layout import StepLayout
from nanoserve.platforms.cpu.attention import (
    CpuKernelAttention,
    CpuKernelMetadata,
    attends_token_by_token,
    with_token_contexts,
)
from nanoserve.platforms.cpu.fast_paths import CpuPaths

CPU = torch.device("cpu")


def decode_step(num_kv_heads: int, group: int, head_dim: int, block_size: int, dtype):
    """A decode-only step of 4 requests: one key, one full block, contexts spanning blocks."""
    torch.manual_seed(head_dim + group)
    k_cache = torch.randn(40, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    seq_lens = [1, block_size, 3 * block_size + 1, 2 * block_size - 1]
    tables = [[7], [3, 9], [30, 2, 11, 5], [39, 0]]  # the last request's spare block unused
    meta = build_reference_metadata([1] * 4, seq_lens, tables, [0] * 4, block_size, CPU)
    query = torch.randn(4, num_kv_heads * group, head_dim, dtype=dtype)
    return query, k_cache, v_cache, meta


@pytest.mark.parametrize("group", [1, 2, 3, 4])  # 3: a pair of heads, then one
# 40: a tail past the 16-wide vectors (AVX-512); 36: past the 8-wide ones too (AVX2)
@pytest.mark.parametrize("head_dim", [128, 64, 40, 36])
def test_kernel_matches_the_eager_decode_in_float32(kernels, group, head_dim):
    query, k_cache, v_cache, meta = decode_step(2, group, head_dim, 4, torch.float32)
    got = kernels.paged_decode_attention(
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.3
    )
    expected = decode_group_attention(query, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 3])
def test_kernel_in_bf16_is_the_float32_attention_rounded_once(kernels, block_size):
    query, k_cache, v_cache, meta = decode_step(8, 2, 128, block_size, torch.bfloat16)
    got = kernels.paged_decode_attention(
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.088
    )
    assert got.dtype == torch.bfloat16
    expected = decode_group_attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.088)
    torch.testing.assert_close(got.float(), expected, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize("count", [2, 3])  # 3: the 8 (request, KV head) tasks dealt unevenly
def test_kernel_splits_requests_across_threads_without_changing_them(kernels, count):
    query, k_cache, v_cache, meta = decode_step(2, 4, 64, 4, torch.bfloat16)
    args = (query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.paged_decode_attention(*args)
        torch.set_num_threads(count)
        many = kernels.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)  # each task is one thread's, summed in the same order


def step_of_runs(runs, block_size=16):
    """A bf16 step of one request per (tokens, context of its last token): each request's
    tokens in a row, token i of n seeing the context but its last n - 1 - i keys (a verify
    step's drafts, a short chunk), its blocks scattered over the cache."""
    torch.manual_seed(len(runs))
    blocks = [-(-context // block_size) for _, context in runs]
    k_cache = torch.randn(sum(blocks) + 2, block_size, 8, 128, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(len(k_cache)).tolist()
    tables = [order[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(runs))]
    width = max(blocks)
    padded = [t + [0] * (width - len(t)) for t in tables]
    token_tables = [row for row, (n, _) in zip(padded, runs, strict=True) for _ in range(n)]
    lens = [context - n + 1 + i for n, context in runs for i in range(n)]
    query = torch.randn(len(lens), 16, 128, dtype=torch.bfloat16)
    return query, k_cache, v_cache, torch.tensor(token_tables), torch.tensor(lens), tables


# (tokens, context): a verify step's 5 tokens over 40 keys; a decode token; 2 tokens over 600
# keys (a chunk) and over 20 (each alone: packing so few keys costs more); 17 over 1,500.
RUNS = [(5, 40), (1, 33), (2, 600), (2, 20), (17, 1500)]


def test_a_requests_tokens_in_a_row_attend_as_its_chunk_would(kernels):
    query, k_cache, v_cache, tables, lens, request_tables = step_of_runs(RUNS)
    got = kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.088)
    first = 0
    for (n, context), table in zip(RUNS, request_tables, strict=True):
        rows = slice(first, first + n)
        as_chunk = kernels.prompt_attention_is_available() and (n >= 3 or context >= 512)
        if as_chunk:  # the prompt kernel's own result over the gathered context, bit for bit
            key, value = (c[table].flatten(0, 1)[:context] for c in (k_cache, v_cache))
            expected = kernels.prompt_attention(query[rows], key, value, 0.088)
        else:  # each token alone
            expected = torch.cat(
                [
                    kernels.paged_decode_attention(
                        query[t : t + 1],
                        k_cache,
                        v_cache,
                        tables[t : t + 1],
                        lens[t : t + 1],
                        0.088,
                    )
                    for t in range(first, first + n)
                ]
            )
        assert torch.equal(got[rows], expected), (n, context)
        first += n
    alone = kernels.paged_decode_attention(  # float32: every token alone
        query.float(), k_cache.float(), v_cache.float(), tables, lens, 0.088
    )
    torch.testing.assert_close(got.float(), alone, atol=4e-3, rtol=2**-7)


def test_tokens_in_other_blocks_or_contexts_are_no_run(kernels):
    """Two requests whose contexts happen to be one key apart, in different blocks, each attend
    alone: their rows are what each gives in a step of its own."""
    query, k_cache, v_cache, tables, lens, _ = step_of_runs([(1, 700), (1, 701), (1, 702)])
    got = kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.088)
    for t in range(3):
        one = kernels.paged_decode_attention(
            query[t : t + 1], k_cache, v_cache, tables[t : t + 1], lens[t : t + 1], 0.088
        )
        assert torch.equal(got[t : t + 1], one)


def test_kernel_refuses_a_context_longer_than_its_block_table(kernels):
    query, k_cache, v_cache, meta = decode_step(2, 2, 64, 4, torch.float32)
    too_long = meta.seq_lens.clone()
    too_long[0] = 17  # tables of 4 blocks of 4 slots
    with pytest.raises(RuntimeError, match="a context of 17 keys in 16 slots"):
        kernels.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, too_long, 0.2)
    with pytest.raises(RuntimeError, match="a cache in the query's dtype or FP8"):
        kernels.paged_decode_attention(
            query.bfloat16(), k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.2
        )


def test_float16_decodes_keep_the_eager_path(kernels):
    query, k_cache, v_cache, meta = decode_step(2, 2, 64, 4, torch.float16)
    got = CpuKernelAttention(kernels).attend_decodes(query, k_cache, v_cache, meta, 0.2)
    assert torch.equal(got, decode_group_attention(query, k_cache, v_cache, meta, 0.2))


def test_cpu_engines_select_it_unless_the_kernels_are_off(kernels, tmp_path):
    config = EngineConfig(model=str(tmp_path), device="cpu")
    assert isinstance(CpuPaths(config, kernels).attention_backend(None), CpuKernelAttention)
    assert type(CpuPaths(config, None).attention_backend(None)) is ReferenceAttention


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_kernel_widens_every_fp8_value_exactly(kernels, cache_dtype):
    """Each finite FP8 code as a one-key context: attention over one key is its value, so the
    output is the kernel's widening of that code (16 lanes vectorised, as one AVX-512 vector or
    two AVX2 ones, 4 more by the scalar tail), equal to PyTorch's conversion."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[codes.view(cache_dtype).float().isfinite()]
    head_dim = 20
    v_cache = codes[:, None, None, None].expand(-1, 1, 1, head_dim).contiguous().view(cache_dtype)
    k_cache = torch.zeros_like(v_cache)
    tables = torch.arange(len(codes))[:, None]  # request i reads block i
    query = torch.ones(len(codes), 1, head_dim)
    got = kernels.paged_decode_attention(
        query, k_cache, v_cache, tables, torch.ones(len(codes), dtype=torch.int64), 1.0
    )
    assert torch.equal(got[:, 0], v_cache.float()[:, 0, 0, :])
    # NaN (e4m3fn's 0x7f and 0xff; e5m2's 0x7d-0x7f, 0xfd-0xff) stays NaN.
    nan_codes = torch.arange(256, dtype=torch.uint8)
    nan_codes = nan_codes[nan_codes.view(cache_dtype).float().isnan()]
    v_nan = nan_codes[:, None, None, None].expand(-1, 1, 1, head_dim).contiguous()
    got = kernels.paged_decode_attention(
        query[: len(nan_codes)],
        k_cache[: len(nan_codes)],
        v_nan.view(cache_dtype),
        tables[: len(nan_codes)],
        torch.ones(len(nan_codes), dtype=torch.int64),
        1.0,
    )
    assert got.isnan().all()


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize(  # 36: a tail past the 8-wide (AVX2) and 16-wide vectors
    ("group", "head_dim", "query_dtype"),
    [
        (1, 128, torch.float32),
        (3, 40, torch.float32),
        (4, 64, torch.bfloat16),
        (2, 36, torch.bfloat16),
    ],
)
def test_kernel_over_an_fp8_cache_matches_the_eager_decode(
    kernels, cache_dtype, group, head_dim, query_dtype
):
    """Contexts of one key, one full block and across blocks, with holes in the pool; the
    reference attends over the same FP8 values widened by PyTorch."""
    query, k_cache, v_cache, meta = decode_step(2, group, head_dim, 4, torch.float32)
    k_cache, v_cache = (3 * k_cache).to(cache_dtype), (3 * v_cache).to(cache_dtype)
    query = query.to(query_dtype)
    got = kernels.paged_decode_attention(
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.3
    )
    assert got.dtype == query_dtype
    expected = decode_group_attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    tolerance = 1e-5 if query_dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), expected, atol=tolerance * 3, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_store_kv_writes_what_index_copy_writes(kernels, dtype):
    """Each token's keys and values land in their slot, byte for byte, values taken from a
    strided slice (as v is of the fused qkv product); a slot outside the pool is refused."""
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 16
    qkv = torch.randn(5, 3 * num_kv_heads * head_dim).to(dtype)  # [T, (q, k, v)]
    k = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].reshape(5, 2, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(5, num_kv_heads, head_dim)  # strided tokens
    slots = torch.tensor([3, 17, 4, 23, 0])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.zeros(shape).to(dtype) for _ in range(4)]
    kernels.store_kv(k, v, caches[0], caches[1], slots)
    write_kv(k, v, caches[2], caches[3], slots)
    for got, expected in zip(caches[:2], caches[2:], strict=True):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(RuntimeError, match="slot 24 of 24"):
        kernels.store_kv(k, v, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 24]))


def test_the_backend_stores_keys_whose_heads_are_apart_as_the_reference_does(kernels):
    """The kernel copies whole token rows; keys whose heads are not side by side in a token
    (here each head's dims strided) go through `write_kv` instead of being refused."""
    torch.manual_seed(2)
    k = torch.randn(5, 16, 2).transpose(1, 2)  # [T, Hkv, D], dims 2 apart
    v = torch.randn(5, 2, 16)
    slots = torch.tensor([3, 17, 4, 23, 0])
    caches = [torch.zeros(6, 4, 2, 16) for _ in range(4)]
    CpuKernelAttention(kernels).store_kv(k, v, caches[0], caches[1], slots)
    write_kv(k, v, caches[2], caches[3], slots)
    assert all(torch.equal(a, b) for a, b in zip(caches[:2], caches[2:], strict=False))


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "one_by_one"),
    [
        ([1] * 8, [3000] * 8, True),  # decode tokens
        ([16], [5000], True),  # a few new tokens over a long document
        ([17], [1500], False),  # more, over a long one: 25,364 pairs
        ([90], [90], True),  # a cold prompt: 4,095 pairs
        ([91], [91], False),  # 4,186 pairs
        ([32, 1], [128, 50], True),  # 32 new tokens over 96 cached (3,600 pairs), a decode
        ([60, 40], [60, 40], True),  # two cold prompts: 1,830 + 820 pairs
        ([60, 60], [60, 100], False),  # a cold prompt and 60 over 40 cached: 1,830 + 4,230
    ],
)
def test_chunks_attend_token_by_token_while_their_tokens_see_few_keys(
    query_lens, seq_lens, one_by_one
):
    layout = StepLayout(query_lens=query_lens, seq_lens=seq_lens)
    assert attends_token_by_token(layout) == one_by_one


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "one_by_one"),
    [
        ([17], [1500], True),  # 17 new tokens over a long document: one run
        ([128], [5000], True),  # a run's most rows
        ([129], [5000], False),  # more
        ([100, 1], [100, 3000], True),  # a cold prompt as one run, and a decode
        ([129, 1], [129, 50], False),
    ],
)
def test_chunks_of_up_to_a_runs_rows_attend_token_by_token_where_runs_are_chunks(
    query_lens, seq_lens, one_by_one
):
    layout = StepLayout(query_lens=query_lens, seq_lens=seq_lens)
    assert attends_token_by_token(layout, chunk_runs=True) == one_by_one


def chunk_over_a_cached_prefix(cache_dtype: torch.dtype):
    """40 new tokens over 600 cached, in shuffled blocks of 16: (q, k, v, caches, layout,
    the reference metadata)."""
    torch.manual_seed(5)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 48, 4, 2, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(cache_dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(cache_dtype)
    table = torch.randperm(num_blocks)[:40].tolist()
    slots = [table[p // block_size] * block_size + p % block_size for p in range(600, 640)]
    meta = build_reference_metadata([40], [640], [table], slots, block_size, CPU)
    q = torch.randn(40, heads, head_dim, dtype=torch.bfloat16)
    k, v = (torch.randn(40, kv_heads, head_dim).to(cache_dtype) for _ in range(2))
    layout = StepLayout(query_lens=[40], seq_lens=[640])
    return q, k, v, k_cache, v_cache, layout, meta


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_chunk_sent_token_by_token_for_its_run_attends_as_the_gathered_chunk(
    kernels, cache_dtype
):
    """Sent to the kernel as one run (bf16: the prompt kernel over the paged cache), or, where
    the kernel cannot attend runs on the cache (FP8), over the gathered context: either way
    what the reference path gives, bit for bit."""
    q, k, v, k_cache, v_cache, layout, meta = chunk_over_a_cached_prefix(cache_dtype)
    backend = CpuKernelAttention(kernels)
    runs = kernels.prompt_attention_is_available()
    run_meta = with_token_contexts(meta, layout, chunk_runs=runs)
    assert (run_meta.token_contexts is not None) == run_meta.needs_runs == runs
    takes = kernels.paged_chunk_attention_takes(q, k_cache)
    assert takes == (runs and cache_dtype == torch.bfloat16)
    caches = (k_cache.clone(), v_cache.clone())
    got = backend.forward(q, k, v, k_cache, v_cache, run_meta, 0.125)
    plain = CpuKernelMetadata(**{f: getattr(meta, f) for f in meta.__dataclass_fields__})
    expected = backend.forward(q, k, v, *caches, plain, 0.125)  # over the gathered context
    assert torch.equal(got, expected)
    assert torch.equal(k_cache.view(torch.uint8), caches[0].view(torch.uint8))  # same writes
