"""Without CUDA the Triton kernels run under Triton's interpreter: the switch must be set before
any test module here imports them (`triton.jit` reads it when it wraps a kernel)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
