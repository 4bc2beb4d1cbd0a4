"""Without CUDA the Triton kernels run under Triton's interpreter: `tests/conftest.py` switches
it on before anything imports triton; this makes sure of it when only these tests run."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
