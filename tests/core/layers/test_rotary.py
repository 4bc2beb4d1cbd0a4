"""RoPE tables and rotation against transformers' rotary embeddings."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from nanoserve.core.layers.ops import apply_rotary
from nanoserve.core.layers.rotary import RotaryEmbedding, compute_inv_freq

HEAD_DIM = 64
MAX_POSITION = 4096

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
}


@pytest.mark.parametrize("rope_type", list(SCALINGS))
def test_rotary_matches_transformers(rope_type):
    scaling = SCALINGS[rope_type]
    theta = 500000.0
    hf_config = LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITION,
        rope_parameters={"rope_theta": theta, "rope_type": "default", **(scaling or {})},
    )
    hf_rope = LlamaRotaryEmbedding(hf_config)
    ours = RotaryEmbedding(HEAD_DIM, MAX_POSITION, theta, scaling)

    assert torch.equal(compute_inv_freq(HEAD_DIM, theta, scaling), hf_rope.inv_freq)
    # Positions well past original_max_position_embeddings, in a scrambled order.
    positions = torch.tensor([0, 1, 7, 511, 512, 513, 2000, MAX_POSITION - 1, 3])
    q = torch.randn(len(positions), 4, HEAD_DIM)  # [T, H, D]
    k = torch.randn(len(positions), 2, HEAD_DIM)  # [T, Hkv, D]
    hf_cos, hf_sin = hf_rope(q, positions[None])  # [1, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin
    )  # [1, H, T, D]
    cos, signed_sin = ours(positions, q.dtype)
    torch.testing.assert_close(apply_rotary(q, cos, signed_sin), hf_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, signed_sin), hf_k[0].transpose(0, 1))


def test_bf16_rotation_is_bit_identical_to_transformers():
    """Same roundings as transformers' x * cos + rotate_half(x) * sin, for q and k at once."""
    hf_config = LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_POSITION
    )
    hf_rope = LlamaRotaryEmbedding(hf_config)
    ours = RotaryEmbedding(HEAD_DIM, MAX_POSITION, hf_config.rope_parameters["rope_theta"])
    positions = torch.tensor([0, 3, 100, 2047, 5])
    qk = torch.randn(len(positions), 6, HEAD_DIM, dtype=torch.bfloat16)  # [T, H + Hkv, D]
    hf_cos, hf_sin = hf_rope(qk, positions[None])  # [1, T, D] in bf16
    hf_q, hf_k = apply_rotary_pos_emb(
        qk[:, :4].transpose(0, 1)[None], qk[:, 4:].transpose(0, 1)[None], hf_cos, hf_sin
    )  # [1, H, T, D], [1, Hkv, T, D]
    rotated = apply_rotary(qk, *ours(positions, torch.bfloat16))
    assert rotated.dtype == torch.bfloat16
    assert torch.equal(rotated[:, :4], hf_q[0].transpose(0, 1))
    assert torch.equal(rotated[:, 4:], hf_k[0].transpose(0, 1))


def test_rotary_keeps_float32_table_and_input_dtype():
    rope = RotaryEmbedding(HEAD_DIM, 128, 10000.0)
    assert rope.cos_cache.dtype == torch.float32
    assert rope.cos_cache.shape == (128, HEAD_DIM // 2)
    x = torch.randn(3, 2, HEAD_DIM, dtype=torch.bfloat16)
    cos, signed_sin = rope(torch.tensor([0, 5, 9]), torch.bfloat16)
    assert cos.shape == signed_sin.shape == (3, 1, HEAD_DIM)
    assert apply_rotary(x, cos, signed_sin).dtype == torch.bfloat16
    # Position 0 is the identity rotation.
    torch.testing.assert_close(apply_rotary(x, cos, signed_sin)[0], x[0])


def test_unsupported_rope_type_lists_supported():
    with pytest.raises(
        ValueError, match="'yarn' is not supported; supported: default, linear, llama3"
    ):
        RotaryEmbedding(HEAD_DIM, 128, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_incomplete_llama3_scaling_is_rejected():
    with pytest.raises(ValueError, match="missing low_freq_factor"):
        compute_inv_freq(
            HEAD_DIM,
            10000.0,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
