"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 as one model with small switches.

    embed_tokens -> N x [RMSNorm -> attention (+RoPE, GQA) -> add -> RMSNorm -> SwiGLU -> add]
                 -> RMSNorm -> lm_head

Switches (from ModelConfig): `attention_bias` (Qwen2: bias on q/k/v), `qk_norm` (Qwen3: RMSNorm
on every head of q and k before RoPE), `rope_scaling` (Llama 3: "llama3" frequencies),
`tie_word_embeddings` (lm_head shares the embedding matrix).

With tensor parallelism (`tp`) each rank holds its share of the heads, of the MLP and of the
vocabulary (`layers/linear.py`).

The model works on one flat batch of tokens from any number of requests: `forward` takes token
ids and positions of shape [T] plus the step's AttentionMetadata, and knows nothing of requests
(the runner may name the rows it samples from, `output_rows`, so that the last layer finishes
only those). Parameters carry checkpoint names (`model.layers.0.self_attn.o_proj.weight`),
except that q/k/v and gate/up are fused into `qkv_proj` and `gate_up_proj` (one matmul each);
the loader copies `q_proj`, `k_proj`, ... into their rows (see MergedColumnLinear).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from nanoserve.common.config import ModelConfig
from nanoserve.core.attention.layer import PagedAttention
from nanoserve.core.attention.metadata import AttentionMetadata
from nanoserve.core.layers.linear import (
    MergedColumnLinear,
    OutputPart,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from nanoserve.core.layers.norm import RMSNorm
from nanoserve.core.layers.ops import PORTABLE_OPS
from nanoserve.core.layers.rotary import RotaryEmbedding
from nanoserve.core.models.base import CausalLM
from nanoserve.core.parallel import TensorParallel


def local_kv_heads(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(KV heads this rank holds, the first of them): N ranks split the KV heads, or, when
    there are fewer KV heads than ranks, share them (each KV head is replicated on N / Hkv
    ranks, as vLLM does)."""
    if num_kv_heads >= tp.size:
        local = tp.split(num_kv_heads, "num_key_value_heads")
        return local, tp.rank * local
    if tp.size % num_kv_heads:
        raise ValueError(
            f"the tensor-parallel size ({tp.size}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads}) when it exceeds it"
        )
    return 1, tp.rank * num_kv_heads // tp.size


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")  # this rank's
        self.num_kv_heads, first_kv_head = local_kv_heads(config.num_key_value_heads, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_start, kv_start = tp.rank * self.q_size, first_kv_head * self.head_dim
        self.qkv_proj = MergedColumnLinear(
            config.hidden_size,
            [
                OutputPart("q_proj", self.q_size, q_start),
                OutputPart("k_proj", self.kv_size, kv_start),
                OutputPart("v_proj", self.kv_size, kv_start),
            ],
            bias=config.attention_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, tp
        )
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5
        )
        self.ops = PORTABLE_OPS  # the q/k norms and RoPE (a platform may install kernels)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # (cos, signed_sin), each [T, 1, D]
        attn_meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [S]: rows to return; None: all
    ) -> torch.Tensor:  # [T or S, hidden]
        num_tokens = x.shape[0]
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 * Hkv) * D]
        # q and k sit side by side in qkv, so one normalization covers all their heads.
        qk = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, num_heads + num_kv_heads, head_dim
        )  # [T, H + Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, num_kv_heads, head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        q, k = self.ops.qk_norm_rotary(qk, num_heads, norms, *rope)  # [T, H, D], [T, Hkv, D]
        out = self.attn(q, k, v, attn_meta)  # [T, H, D]
        if output_rows is not None:
            out = out[output_rows]  # [S, H, D]
        return self.o_proj(out.reshape(out.shape[0], self.q_size))  # [., H * D] -> [., hidden]


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        size = tp.split(config.intermediate_size, "intermediate_size")  # this rank's share
        parts = [OutputPart(name, size, tp.rank * size) for name in ("gate_proj", "up_proj")]
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, parts, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp)
        self.ops = PORTABLE_OPS  # silu(gate) * up (a platform may install a kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate / N]: gate, then up
        return self.down_proj(self.ops.silu_mul(gate_up))  # [T, intermediate / N] -> [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [S]: rows to return; None: all
    ) -> torch.Tensor:  # [T or S, hidden]
        attn_out = self.self_attn(self.input_layernorm(x), rope, attn_meta, output_rows)
        if output_rows is not None:
            x = x[output_rows]
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (no LM head)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        # One RoPE table shared by all layers; cos/sin are looked up once per step.
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn_meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [S]: rows to return; None: all
    ) -> torch.Tensor:  # [T or S, hidden]
        """Hidden states of every token, or only of `output_rows` (the rows to sample from).

        Every layer must write all T tokens' keys and values to the cache, but past the last
        layer's attention only the returned rows matter: there `output_rows` skips the output
        projection and MLP of the others (for a prompt, all but its last token).
        """
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb(positions, x.dtype)  # (cos, signed_sin), each [T, 1, D]
        *layers, last_layer = self.layers
        for layer in layers:
            x = layer(x, rope, attn_meta)
        x = last_layer(x, rope, attn_meta, output_rows)  # [T or S, hidden]
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    """A Llama-family causal LM: hidden states for a flat token batch, logits on request."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn_meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [S]: rows to return; None: all
    ) -> torch.Tensor:  # [T or S, hidden]
        return self.model(input_ids, positions, attn_meta, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        """float32 logits; with tensor parallelism only rank 0 gets them (the others: empty)."""
        logits = self.lm_head.logits(hidden)
        return logits if logits is not None else hidden.new_empty(0, dtype=torch.float32)

    def attention_layers(self) -> list[PagedAttention]:
        """The PagedAttention module of every layer, in order, for binding KV caches."""
        layers = cast(list[LlamaDecoderLayer], list(self.model.layers))
        return [layer.self_attn.attn for layer in layers]
