"""Frozen configuration, one dataclass per boundary, validated where it is made (torch-free).

`EngineConfig` is what a user chooses (the CLI's flags take their defaults from it); it checks
every value when it is made, so a bad setting is a one-line error before any weight loads.
`CacheConfig` and `SchedulerConfig` are the parts the KV cache and the scheduler receive, made
from it once the model's own limits are known (`ModelConfig`, read from config.json).

Values found at run time (the number of KV blocks, EOS ids) live beside these configs in the
objects that discover them; they are never written back into a config.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.common.speculative_config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("int8",)
# How the KV cache stores keys and values (vLLM's names): auto is the model's dtype, fp8 is e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEFAULT_MIN_BATCHED_TOKENS = 2048


def resolve_auto_dtype(checkpoint_dtype: str, device_type: str, device_has_bf16: bool) -> str:
    """`--dtype auto` as vLLM resolves it: the checkpoint's dtype, except that float32 runs in
    bfloat16 where the device has bf16 (float16 on CUDA without it) and float16 runs in bfloat16
    on CPU. Torch-free: the front sizes KV blocks with it, the worker builds the model with it."""
    dtype = checkpoint_dtype if checkpoint_dtype in DTYPES else "bfloat16"
    if dtype == "float32" and device_has_bf16:
        return "bfloat16"
    if dtype == "float32" and device_type == "cuda":
        return "float16"
    if dtype == "float16" and device_type == "cpu":
        return "bfloat16"
    return dtype


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts part of a model (Qwen3-MoE, Mixtral), from its config.json."""

    num_experts: int
    num_experts_per_tok: int  # top-k: experts each token runs through
    moe_intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool = True  # renormalize the top-k probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (a dense MLP then)

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                f"({self.num_experts})"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_sparse(self, layer_index: int) -> bool:
        """Whether decoder layer `layer_index` routes to experts (else it has a dense MLP)."""
        is_step = (layer_index + 1) % self.decoder_sparse_step == 0
        return is_step and layer_index not in self.mlp_only_layers


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
    quantization: dict | None = None  # config.json's quantization_config (FP8 checkpoints)
    moe: MoeConfig | None = None  # the experts of a mixture-of-experts model

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
    kv_cache_memory: int | None = None  # bytes; the CPU budget (default: up to 2 GiB on CPU)
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory for weights + KV on CUDA
    num_blocks_override: int | None = None  # tests: exact pool size, ignoring the budgets
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3 | fp8_e5m2
    calculate_kv_scales: bool = False  # fp8: scales from the first prompt step, not 1.0

    def __post_init__(self) -> None:
        _require(
            self.cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}",
        )
        _require(
            self.block_size >= 1 and not self.block_size & (self.block_size - 1),
            f"block_size must be a power of two ≥ 1, got {self.block_size}",
        )
        _require(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(
            self.num_blocks_override is None or self.num_blocks_override >= 2,
            f"num_kv_blocks must be ≥ 2, got {self.num_blocks_override}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits on one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MIN_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _require(getattr(self, name) >= 1, f"{name} must be ≥ 1, got {getattr(self, name)}")
        _require(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
            f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
            f"must be ≥ max_model_len ({self.max_model_len})",
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start: which model, on what, with what limits."""

    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    load_format: str = "auto"  # auto (safetensors) | safetensors | dummy (random weights)
    revision: str | None = None  # hub branch, tag or commit of `model`
    download_dir: str | None = None  # hub cache directory (default: huggingface_hub's)
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # default: max(2048, max_model_len)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; default on CPU: up to 2 GiB
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # tests: exact KV pool size
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    quantization: str | None = None  # int8: weight-only int8 linears
    quantize_lm_head: bool = True  # with a quantization, the LM head too
    tensor_parallel_size: int = 1  # ranks (processes) one model is split across
    enable_expert_parallel: bool = False  # MoE: whole experts per rank, not a slice of each
    nnodes: int = 1  # machines those ranks run on
    node_rank: int = 0  # this machine's index among them
    master_addr: str = "127.0.0.1"  # where rank 0 (node 0) meets the others
    master_port: int | None = None  # None: a free port on this machine (one node)
    data_parallel_size: int = 1  # independent engines behind one front (one machine)
    data_parallel_rank: int = 0  # which of them this engine is (set by the front)
    compile_decode: bool = False  # torch.compile the decode step (slow start-up, faster tokens)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (= fp8_e4m3) | fp8_e5m2
    calculate_kv_scales: bool = False  # fp8 KV without checkpoint scales: measure them, not 1.0
    enforce_eager: bool = False  # the plain path, whatever else is asked for
    speculative_config: SpeculativeConfig | None = None  # drafts verified in one pass

    def __post_init__(self) -> None:
        _require(
            self.dtype == "auto" or self.dtype in DTYPES,
            f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}",
        )
        _require(
            self.device in ("auto", "cpu", "cuda") or _is_cuda_index(self.device),
            f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        _require(
            self.load_format in LOAD_FORMATS,
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}",
        )
        _require(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}",
        )
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"{name} must be ≥ 1, got {value}")
        self._check_parallelism()
        _require(
            self.kv_cache_dtype == "auto" or not self.use_compiled_decode,
            f"kv_cache_dtype {self.kv_cache_dtype} does not combine with compile_decode; use one "
            "of them (or add enforce_eager)",
        )
        self.cache_config()  # validates the cache settings
        if self.max_model_len is not None:
            self.scheduler_config(self.max_model_len)  # validates the scheduler limits

    def _check_parallelism(self) -> None:
        for name in ("tensor_parallel_size", "nnodes", "data_parallel_size"):
            _require(getattr(self, name) >= 1, f"{name} must be ≥ 1, got {getattr(self, name)}")
        _require(
            0 <= self.data_parallel_rank < self.data_parallel_size,
            f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
            f"got {self.data_parallel_rank}",
        )
        _require(
            self.data_parallel_size == 1 or self.nnodes == 1,
            "data_parallel_size > 1 runs its engines on one machine; nnodes must be 1",
        )
        _require(
            self.tensor_parallel_size % self.nnodes == 0,
            f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of nnodes "
            f"({self.nnodes}): every machine runs the same number of ranks",
        )
        _require(
            0 <= self.node_rank < self.nnodes,
            f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}",
        )
        _require(
            self.nnodes == 1 or self.master_port is not None,
            "a group on several machines needs master_port (and master_addr, node 0's address)",
        )

    @property
    def use_compiled_decode(self) -> bool:
        return self.compile_decode and not self.enforce_eager

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_blocks_override=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
        )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits once the model's context length is known."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens
            or max(DEFAULT_MIN_BATCHED_TOKENS, max_model_len),
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )

    def resolve_max_model_len(self, model_config: ModelConfig) -> int:
        """The chosen max_model_len, or the model's; an error if the model cannot reach it."""
        max_positions = model_config.max_position_embeddings
        if self.max_model_len is None:
            return max_positions
        _require(
            self.max_model_len <= max_positions,
            f"max_model_len ({self.max_model_len}) is larger than the model's "
            f"max_position_embeddings ({max_positions}); use max_model_len {max_positions} or less",
        )
        return self.max_model_len


def _is_cuda_index(device: str) -> bool:
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isdigit()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
