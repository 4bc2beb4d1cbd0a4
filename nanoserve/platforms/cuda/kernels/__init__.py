"""Triton kernels of the CUDA attention backend (`platforms/cuda/attention.py`).

    store_kv.py   write each token's K and V into its slot of the paged cache
    decode.py     one query per request over its paged context, split along the context
                  (flash-decoding), then the splits merged
    prefill.py    a ragged batch of queries (prompts, chunks after a cached prefix, decodes)
                  over their paged contexts, causal, online softmax (flash attention)

Every kernel reads the cache through block tables, in the layout the scheduler and the prefix
cache use: [num_blocks, block_size, num_kv_heads, head_dim]. The tests run them on CPU tensors
under TRITON_INTERPRET=1 against the reference backend.
"""

import os

import torch


def fp32_products(dtype: torch.dtype) -> bool:
    """Whether attention kernels multiply tiles in exact float32 rather than in `dtype`.

    float32 caches get exact products (the GPU would round them to tf32). Under TRITON_INTERPRET
    (the CPU tests) every dtype does: the interpreter multiplies bf16 and fp16 tiles wrongly.
    On the GPU bf16 and fp16 tiles go to the tensor cores as they are.
    """
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
