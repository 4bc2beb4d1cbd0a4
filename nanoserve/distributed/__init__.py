"""Tensor parallelism: one model across several processes with torch.distributed.

    parallel.py         joining the group (NCCL on CUDA, gloo on CPU)
    step_broadcast.py   rank 0 sends each step's layout to the other ranks, which follow it

It enters the core through two plug points: the `TensorParallel` view the model's layers shard
themselves by (`core/parallel.py`; with a group of one they are the plain layers), and a step
runner that broadcasts each step before running it (`core/model_runner.py`'s `StepRunner`).
"""
