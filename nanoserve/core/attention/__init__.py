"""Paged attention: one description of the step, interchangeable backends.

    metadata.py    AttentionMetadata: how one step's flat token batch maps onto requests and slots
    layer.py       PagedAttention (the module the model calls) and the AttentionBackend interface
    reference.py   plain PyTorch, CPU and CUDA: the backend every other one is tested against

Fast backends live with their platform (`nanoserve/platforms/cpu/attention.py`, the C++ decode
kernel; `nanoserve/platforms/cuda/attention.py`, Triton). The engine binds one backend, with the
KV cache, to every layer; the model file never branches on the backend.
"""
