"""Frozen configuration, one dataclass per boundary, validated where it is made.

Values found at run time (the number of KV blocks, EOS ids) live beside these configs in the
objects that discover them; they are never written back into a config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the HTTP front imports these configs and must not pay for importing torch
    import torch

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family transformer, read from a checkpoint's config.json."""

    architecture: str  # e.g. "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    torch_dtype: str = "float32"  # the checkpoint's dtype as written in config.json
    eos_token_ids: tuple[int, ...] = ()  # from config.json; generation_config may add more

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is laid out and how much memory it may take."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; the CPU budget (default: 2 GiB on CPU)
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory for weights + KV on CUDA
    num_blocks_override: int | None = None  # tests: exact pool size, ignoring the budgets
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two ≥ 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(f"num_blocks_override must be ≥ 2, got {self.num_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits on one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be ≥ max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start: which model, on what, with what limits."""

    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights from config)
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # default: max(2048, max_model_len)
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # tests: exact KV pool size
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # torch.compile the decode step: on CPU ~2x faster per token, but it compiles for tens of
    # seconds (minutes for billion-parameter shapes on 2 cores) at start-up. Off by default.
    compile_decode: bool = False
    enforce_eager: bool = False  # the plain path, whatever else is asked for
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors or dummy, got {self.load_format!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be ≥ 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be ≥ 1, got {self.max_num_seqs}")

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for, but CUDA is not available")
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
        """`auto` is the checkpoint's dtype, except float16 becomes bfloat16 on CPU."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        dtype = getattr(torch, checkpoint_dtype) if checkpoint_dtype in DTYPES else torch.bfloat16
        if dtype == torch.float16 and device.type == "cpu":
            return torch.bfloat16
        return dtype
