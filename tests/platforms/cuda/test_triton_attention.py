"""The Triton kernels against the eager backend: on CPU under TRITON_INTERPRET=1, on CUDA as is.

Every output starts as NaN so that an element a kernel forgets to write fails; block tables
have shuffled ids and holes (unused blocks between a request's); lengths sit at 1, at block
boundaries and at max_model_len. The interpreter is slow, so the CPU cases are small; the full
sweep is marked `gpu`.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve.core.attention.reference import build_reference_metadata, paged_attention
from nanoserve.platforms.cuda.attention import TritonAttention
from nanoserve.platforms.cuda.kernels.decode import (
    num_decode_splits,
    paged_decode_attention,
)
from nanoserve.platforms.cuda.kernels.prefill import ragged_prefill_attention
from nanoserve.platforms.cuda.kernels.store_kv import store_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 96  # 6 blocks
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def scatter_block_tables(seq_lens: list[int], rng: random.Random) -> tuple[list[list[int]], int]:
    """Shuffled block ids with unused blocks in between; returns the tables and the pool size."""
    needed = sum(-(-n // BLOCK_SIZE) for n in seq_lens)
    num_blocks = 2 * needed + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = []
    for seq_len in seq_lens:
        tables.append([free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))])
        free.pop()  # a hole: a block nobody owns
    return tables, num_blocks


def make_step(
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed, cache_dtype=None
):
    """Random queries and caches (in `cache_dtype`, default the queries'), and the metadata of
    one step with these lengths."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tables, num_blocks = scatter_block_tables(seq_lens, rng)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE).to(cache_dtype or dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(cache_dtype or dtype)
    slots = [
        table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for table, q_len, s_len in zip(tables, query_lens, seq_lens, strict=True)
        for p in range(s_len - q_len, s_len)
    ]
    meta = build_reference_metadata(query_lens, seq_lens, tables, slots, BLOCK_SIZE, DEVICE)
    query = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype, device=DEVICE)
    return query, k_cache, v_cache, meta


def assert_matches_eager(got, query, k_cache, v_cache, meta, scale):
    expected = paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert not got.isnan().any(), "an output element was not written"
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[query.dtype], rtol=0)


def check_decode(
    seq_lens, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0, cache_dtype=None
):
    query, k_cache, v_cache, meta = make_step(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed, cache_dtype
    )
    max_blocks = meta.block_tables.shape[1]
    for num_splits in {1, 2, num_decode_splits(len(seq_lens), num_kv_heads, max_blocks)}:
        out = torch.full_like(query, float("nan"))
        got = paged_decode_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125, num_splits, out
        )
        assert got is out
        assert_matches_eager(got, query, k_cache, v_cache, meta, 0.125)


def check_prefill(
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0, cache_dtype=None
):
    query, k_cache, v_cache, meta = make_step(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed, cache_dtype
    )
    out = torch.full_like(query, float("nan"))
    got = ragged_prefill_attention(
        query,
        k_cache,
        v_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        0.125,
        max(query_lens),
        out,
    )
    assert_matches_eager(got, query, k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_matches_eager(group, head_dim):
    # One token, a full block, one past a boundary, and max_model_len.
    check_decode([1, BLOCK_SIZE, BLOCK_SIZE + 1, MAX_MODEL_LEN], 2 * group, 2, head_dim)


def test_decode_attention_in_bf16():
    check_decode([3, 40], 8, 2, 64, torch.bfloat16)


@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (4, 128), (8, 64)])
def test_prefill_attention_over_a_ragged_mixed_batch(group, head_dim):
    """Decodes, a fresh prompt, a chunk after a cached prefix, and a prompt of max_model_len."""
    query_lens = [1, 1, 37, 20, MAX_MODEL_LEN]
    seq_lens = [1, 33, 37, 52, MAX_MODEL_LEN]
    check_prefill(query_lens, seq_lens, 2 * group, 2, head_dim, torch.float32)


def test_prefill_attention_in_bf16():
    check_prefill([5, 16, 17], [5, 40, 17], 4, 2, 64, torch.bfloat16)


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize(("dtype", "group"), [(torch.float32, 1), (torch.bfloat16, 4)])
def test_decode_attention_over_an_fp8_cache(cache_dtype, dtype, group):
    """FP8 keys and values widen exactly: the result is the attention over their values."""
    seq_lens = [1, BLOCK_SIZE, BLOCK_SIZE + 1, MAX_MODEL_LEN]
    check_decode(seq_lens, 2 * group, 2, 64, dtype, cache_dtype=cache_dtype)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_prefill_attention_over_an_fp8_cache(cache_dtype):
    query_lens, seq_lens = [1, 16, 20, 17], [1, 16, 52, 17]
    check_prefill(query_lens, seq_lens, 4, 2, 64, torch.bfloat16, cache_dtype=cache_dtype)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_store_kv_copies_fp8_bytes_and_skips_padding(cache_dtype):
    shape = (4, BLOCK_SIZE, 2, 64)
    k_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    k = (8 * torch.randn(3, 2, 64, device=DEVICE)).to(cache_dtype)
    v = (8 * torch.randn(3, 2, 64, device=DEVICE)).to(cache_dtype)
    store_kv(k, v, k_cache, v_cache, torch.tensor([5, 63, -1], device=DEVICE))
    flat_k, flat_v = k_cache.view(-1, 2, 64).view(torch.uint8), v_cache.view(-1, 2, 64)
    assert torch.equal(flat_k[[5, 63]], k[:2].view(torch.uint8))
    assert torch.equal(flat_v.view(torch.uint8)[[5, 63]], v[:2].view(torch.uint8))
    assert flat_k.sum(dtype=torch.int64) == k[:2].view(torch.uint8).sum(dtype=torch.int64)


def test_triton_backend_behind_the_fp8_wrapper_matches_the_reference():
    """Fp8KVAttention around Triton and around the reference: the same cache bytes, the same
    attention (scales not 1.0: queries and outputs are scaled around the kernels)."""
    from nanoserve.core.attention.reference import ReferenceAttention
    from nanoserve.quantization.kv_cache_fp8 import Fp8KVAttention, KVScales

    fp8 = torch.float8_e4m3fn
    scales = KVScales(1, DEVICE, {0: {"k": 0.05, "v": 0.02}})
    query, k_cache, v_cache, meta = make_step([1, 9], [17, 9], 4, 2, 64, torch.float32, 3, fp8)
    new_k, new_v = 3 * torch.randn(10, 2, 64, device=DEVICE), torch.randn(10, 2, 64, device=DEVICE)
    outputs, caches = [], []
    for inner in (TritonAttention(num_kv_heads=2), ReferenceAttention()):
        backend = Fp8KVAttention(inner, fp8, scales).for_layer(0)
        k_pool, v_pool = k_cache.clone(), v_cache.clone()
        outputs.append(backend.forward(query, new_k, new_v, k_pool, v_pool, meta, 0.2))
        caches.append((k_pool.view(torch.uint8), v_pool.view(torch.uint8)))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-5, rtol=0)


def test_store_kv_writes_each_slot_and_nothing_else():
    rng = random.Random(0)
    num_blocks, num_kv_heads, head_dim = 6, 2, 64
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE)
    v_cache = torch.full(shape, float("nan"), device=DEVICE)
    slots = rng.sample(range(num_blocks * BLOCK_SIZE), 20) + [-1]  # the last row is padding
    qkv = torch.randn(len(slots), 3 * num_kv_heads * head_dim, device=DEVICE)
    k = qkv[:, : num_kv_heads * head_dim].reshape(len(slots), num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(len(slots), num_kv_heads, head_dim)  # strided
    store_kv(k, v, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    written = torch.tensor(slots[:-1], device=DEVICE)
    torch.testing.assert_close(flat_k[written], k[:-1], atol=0, rtol=0)
    torch.testing.assert_close(flat_v[written], v[:-1], atol=0, rtol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_triton_backend_writes_then_attends_like_eager():
    """The backend's forward: new K/V into the cache, then attention over cache and new keys."""
    query, k_cache, v_cache, meta = make_step([1, 9], [17, 9], 4, 2, 64, torch.float32, seed=3)
    new_k = torch.randn(10, 2, 64, device=DEVICE)
    new_v = torch.randn(10, 2, 64, device=DEVICE)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    got = TritonAttention(num_kv_heads=2).forward(query, new_k, new_v, k_cache, v_cache, meta, 0.2)
    for cache, new in ((eager_k, new_k), (eager_v, new_v)):
        cache.view(-1, 2, 64).index_copy_(0, meta.slot_mapping, new)
    torch.testing.assert_close(k_cache, eager_k, atol=0, rtol=0)
    expected = paged_attention(query, eager_k, eager_v, meta, 0.2)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


def test_decode_splits_grow_for_few_long_contexts():
    assert num_decode_splits(1, 8, 1) == 1  # one block: nothing to split
    assert num_decode_splits(1, 8, 256) == 32  # one long context: spread it
    assert num_decode_splits(64, 8, 256) == 1  # 512 programs already
    assert all(n & (n - 1) == 0 for n in (num_decode_splits(3, 2, 50), num_decode_splits(5, 1, 9)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_full_sweep_on_cuda(dtype, group, head_dim):
    rng = random.Random(group * head_dim)
    for seed in range(3):
        seq_lens = [rng.randint(1, MAX_MODEL_LEN) for _ in range(rng.randint(1, 24))]
        check_decode(seq_lens, 2 * group, 2, head_dim, dtype, seed)
        query_lens = [rng.randint(1, n) for n in seq_lens]
        check_prefill(query_lens, seq_lens, 2 * group, 2, head_dim, dtype, seed)
