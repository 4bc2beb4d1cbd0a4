"""The CPU linear methods: oneDNN-packed weights give F.linear's numbers, eager and compiled;
decode steps stream the GEMV's copy of the weight (in the kernels' layout) through it; on a CPU
whose oneDNN cannot pack bf16 (no AVX-512) the weights stay bf16 and large products widen them
to float32.

The packed method's tests need a CPU that packs; the widening method's run on every CPU (a
packing CPU is told it cannot)."""

import random

import pytest
import torch
import torch.nn.functional as F
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.common.cpu_features import cpu_flags
from nanoserve.core.layers.linear import DENSE, Linear
from nanoserve.platforms.cpu import linear as cpu_linear
from nanoserve.platforms.cpu.kernels import load_cpu_kernels
from nanoserve.platforms.cpu.linear import (
    GEMV_CALL_ROWS,
    WIDEN_MIN_ROWS,
    PackedLinearMethod,
    WideningLinearMethod,
    decode_gemv,
    decode_gemv_layout,
    install_cpu_linears,
    one_token_linear,
    packing_works,
    tuned_gemv_rows,
)

GEMV_ROWS = 4  # what the tests below give PackedLinearMethod (machines tune their own)

needs_packing = pytest.mark.skipif(
    not packing_works(), reason="this CPU's oneDNN cannot pack bf16 weights (needs AVX-512)"
)


def test_packing_is_asked_of_onednn_and_matches_the_cpu():
    """oneDNN packs bf16 where the CPU has AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT."""
    flags = set(cpu_flags() or [])
    expected = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert packing_works() == expected
    assert cpu_linear.can_pack(torch.zeros(1, dtype=torch.bfloat16)) == expected
    assert not cpu_linear.can_pack(torch.zeros(1))  # float32 never


def _linear(bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    layer = Linear(48, 40, bias=bias).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    return layer, weight, None if layer.bias is None else layer.bias.detach().clone()


@pytest.fixture
def without_gemv(monkeypatch):
    """Every eager product by the packed weight, as where the GEMV is not built."""
    monkeypatch.setattr(cpu_linear, "decode_gemv", lambda: None)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_bit_for_bit(bias, without_gemv):
    layer, weight, bias_values = _linear(bias)
    assert install_cpu_linears(layer, keep_plain_weights=False) == 1
    assert isinstance(layer.method, PackedLinearMethod)
    assert layer.weight is None and layer.packed_weight is not None
    for num_tokens in (1, 3, 17):
        x = torch.randn(num_tokens, 48, dtype=torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, weight, bias_values))


def test_this_machine_has_the_decode_gemv():
    """The GEMV has a SIMD path on the CI image's CPU (AVX512-BF16, or AVX2 and FMA); without
    one the test below would test nothing new."""
    assert decode_gemv() is not None


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_features", "out_features"), [(48, 40), (96, 128)])
def test_decode_steps_stream_the_gemvs_copy_of_the_weight(bias, in_features, out_features):
    """The GEMV reads its own copy, laid out by the kernels (in blocks of 64 rows where the
    block GEMV takes the shape: 128 rows here on AVX-512 BF16; 40 rows stay plain)."""
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    bias_values = None if layer.bias is None else layer.bias.detach().clone()
    gemv, layout, rows_seen = decode_gemv(), decode_gemv_layout(), []
    assert gemv is not None and layout is not None
    method = PackedLinearMethod(
        False, lambda x, w: rows_seen.append(len(x)) or gemv(x, w), GEMV_ROWS, layout
    )
    layer.method = method
    method.process_weights(layer)
    assert layer.weight is None and layer.packed_weight is not None  # the plain one dropped
    assert layer.gemv_weight.shape == layout(weight).shape
    kernels = load_cpu_kernels()
    blocked = kernels is not None and kernels.block_gemv_takes(weight)
    tiled = kernels is not None and kernels.amx_gemv_takes(weight)
    assert layer.gemv_weight.dim() == (5 if tiled else 4 if blocked else 2)
    for num_tokens in (1, GEMV_ROWS, GEMV_ROWS + 1, 17):
        x = torch.randn(num_tokens, in_features, dtype=torch.bfloat16)
        expected = F.linear(x, weight, bias_values)
        if num_tokens <= GEMV_ROWS:  # float32 sums in another order, one bf16 rounding
            torch.testing.assert_close(layer(x), expected, atol=1e-3, rtol=2**-7)
        else:  # the packed product, bit for bit
            assert torch.equal(layer(x), expected)
    assert rows_seen == [1, GEMV_ROWS]


@needs_packing
def test_a_kept_plain_weight_stays_beside_the_gemvs_copy():
    """With --compile the plain weight is kept (one-token products read it compiled)."""
    layer, weight, _ = _linear(bias=False)
    method = PackedLinearMethod(True, decode_gemv(), GEMV_ROWS, decode_gemv_layout())
    layer.method = method
    method.process_weights(layer)
    assert torch.equal(layer.weight, weight) and layer.gemv_weight is not None


@needs_packing
def test_where_the_gemv_wins_at_no_size_only_the_packed_weight_is_kept():
    layer, weight, _ = _linear(bias=True)
    method = PackedLinearMethod(False, decode_gemv(), gemv_max_rows=0)
    layer.method = method
    method.process_weights(layer)
    assert method.gemv is None and layer.weight is None  # one copy of the weights
    for num_tokens in (1, 5):
        x = torch.randn(num_tokens, 48, dtype=torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, weight, layer.bias))


@needs_packing
def test_packed_linear_under_torch_compile(without_gemv):
    layer, weight, _ = _linear(bias=False)
    install_cpu_linears(layer, keep_plain_weights=False)
    compiled = torch.compile(lambda x: layer(x * 2.0) + 1.0, dynamic=True)
    with torch.inference_mode():
        # One graph: sizes above 1 share it (a compiled one-token step reads the plain weight
        # instead, which test_compiled_decode_keeps_the_plain_weight_for_one_token_steps keeps).
        for num_tokens in (2, 5):
            x = torch.randn(num_tokens, 48, dtype=torch.bfloat16)
            expected = F.linear(x * 2.0, weight) + 1.0
            torch.testing.assert_close(compiled(x), expected)


def test_only_bf16_cpu_weights_are_packed():
    layer = Linear(8, 4, bias=False)  # float32
    assert install_cpu_linears(layer, keep_plain_weights=False) == 0
    assert layer.weight is not None and layer.method is DENSE


@needs_packing
def test_engine_packs_bf16_weights_and_generates_the_same_tokens(
    tmp_path, monkeypatch, without_gemv
):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")  # tied embeddings
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (5, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)

    llm = LLM(checkpoint, dtype="bfloat16")
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None and m.weight is None for m in linears)
    assert all(isinstance(m.method, PackedLinearMethod) for m in linears)
    assert model.model.embed_tokens.weight is not None  # the tied head's plain tensor lives on
    packed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    monkeypatch.setattr(cpu_linear, "packing_works", lambda: False)  # as on an AVX2-only CPU
    plain_llm = LLM(checkpoint, dtype="bfloat16")
    plain_linears = [m for m in plain_llm.engine.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.method, WideningLinearMethod) for m in plain_linears)
    assert [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)] == packed


def test_engine_decodes_through_the_gemv_where_it_is_faster_here(tmp_path):
    """Packed: the GEMV takes products of up to the size the build timed it faster (keeping
    its copy of the weights for them), or none; widened: every product under 32 tokens."""
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")
    llm = LLM(checkpoint, dtype="bfloat16", enforce_eager=True)  # the linears, layer by layer
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.method, PackedLinearMethod) == packing_works() for m in linears)
    most_rows = tuned_gemv_rows() if packing_works() else GEMV_CALL_ROWS
    assert all((m.method.gemv is not None) == (most_rows > 0) for m in linears)
    if packing_works():
        assert all(m.weight is None for m in linears)  # the plain weight itself: not kept
        assert all(
            (getattr(m, "gemv_weight", None) is not None) == (most_rows > 0) for m in linears
        )
    rows_seen: list[int] = []
    if most_rows > 0:
        gemv = linears[0].method.gemv
        linears[0].method.gemv = lambda x, w: rows_seen.append(len(x)) or gemv(x, w)
    # Decode steps of two requests, then of one (the GEMV may take only one row).
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in (6, 9)]
    outputs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 9]
    if most_rows > 0:
        assert min(most_rows, 2) in rows_seen  # decode steps
        assert max(rows_seen) <= most_rows


@needs_packing
@pytest.mark.slow
def test_compiled_decode_keeps_the_plain_weight_for_one_token_steps(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "llama")
    llm = LLM(checkpoint, dtype="bfloat16", compile_decode=True)  # compiles in warm-up
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert all(m.packed_weight is not None and m.weight is not None for m in linears)
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    for batch in ([[1, 2, 3]], [[1, 2, 3], [4, 5], [6] * 9]):  # one-token and batched decode
        outputs = llm.generate(batch, params)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [6] * len(batch)


def test_one_token_linear_matches_f_linear():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(1, 48), torch.randn(40, 48), torch.randn(40)
    torch.testing.assert_close(one_token_linear(x, weight, bias), F.linear(x, weight, bias))
    torch.testing.assert_close(one_token_linear(x, weight, None), F.linear(x, weight))


# ---- a CPU whose oneDNN cannot pack bf16 (AVX2 only: most laptops) ----


@pytest.fixture
def cannot_pack(monkeypatch):
    monkeypatch.setattr(cpu_linear, "packing_works", lambda: False)


@pytest.mark.parametrize("bias", [False, True])
def test_widened_products_equal_f_linear_in_float32(bias, cannot_pack):
    layer, weight, bias_values = _linear(bias)
    assert install_cpu_linears(layer, keep_plain_weights=False) == 1
    assert isinstance(layer.method, WideningLinearMethod)
    assert layer.weight is not None and getattr(layer, "packed_weight", None) is None
    for num_tokens in (1, GEMV_CALL_ROWS, 19, WIDEN_MIN_ROWS, 70):
        x = torch.randn(num_tokens, 48, dtype=torch.bfloat16)
        wide = F.linear(
            x.float(), weight.float(), None if bias_values is None else bias_values.float()
        )
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, 40)
        # float32 sums of exact bf16 products, rounded once to bf16 (the GEMV adds in another order)
        torch.testing.assert_close(got.float(), wide, atol=1e-3, rtol=2**-7)
        if num_tokens >= WIDEN_MIN_ROWS:
            assert torch.equal(got, wide.to(torch.bfloat16))


def test_widening_small_products_stream_the_bf16_weight_through_the_gemv(cannot_pack):
    """Up to WIDEN_MIN_ROWS - 1 tokens the GEMV takes them, 8 rows a call; more are widened."""
    layer, _, _ = _linear(bias=False)
    install_cpu_linears(layer, keep_plain_weights=False)
    assert layer.method.gemv is not None
    gemv, rows_seen = layer.method.gemv, []
    layer.method.gemv = lambda x, w: rows_seen.append(len(x)) or gemv(x, w)
    for num_tokens in (1, GEMV_CALL_ROWS, 19, WIDEN_MIN_ROWS):
        layer(torch.randn(num_tokens, 48, dtype=torch.bfloat16))
    assert rows_seen == [1, GEMV_CALL_ROWS, 8, 8, 3]


def test_engine_without_packing_generates_the_dense_tokens(tmp_path, monkeypatch, cannot_pack):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (5, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    llm = LLM(checkpoint, dtype="bfloat16")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, WideningLinearMethod) for m in linears)
    widened = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    monkeypatch.setattr(cpu_linear, "is_bf16_cpu", lambda weight: False)
    dense = LLM(checkpoint, dtype="bfloat16")
    assert all(m.method is DENSE for m in dense.engine.model.modules() if isinstance(m, Linear))
    assert [o.outputs[0].token_ids for o in dense.generate(prompts, params)] == widened
