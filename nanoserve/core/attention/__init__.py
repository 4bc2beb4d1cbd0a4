"""Paged attention: one description of the step, several interchangeable backends.

    metadata.py   AttentionMetadata: how one step's flat token batch maps onto requests and slots
    layer.py      PagedAttention (the module the model calls) and the AttentionBackend interface
    eager.py      plain PyTorch, CPU and CUDA: the reference every other backend is tested against
    cpu.py        the compiled CPU decode path (torch.compile fuses its decode attention)

The model runner picks one backend per engine and binds it, with the KV cache, to every layer;
the model file never branches on the backend.
"""
