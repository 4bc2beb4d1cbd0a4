"""Plug-in: mixture-of-experts models (Qwen3-MoE, Mixtral).

    routing.py   the router's top-k, and a step's (token, expert) pairs grouped by expert
    layer.py     SparseMoeBlock (router + stacked experts, sharded by tensor or expert
                 parallelism) and MoeMethod, its plug point; the portable grouped method
    models.py    Qwen3MoeForCausalLM and MixtralForCausalLM: the Llama family's layers with
                 experts in place of the MLP; expert load counts
    cpu.py       CpuMoeMethod: decode steps through the C++ grouped GEMV (selected experts only)
    int8.py      Int8MoeMethod: per-channel int8 experts (--quantization int8)
    setup.py     which method this machine and these settings get

The core knows none of this: `engine_setup.py` registers the model classes
(`FastPaths.model_classes`) and installs the methods (`FastPaths.prepare_model`).
"""
