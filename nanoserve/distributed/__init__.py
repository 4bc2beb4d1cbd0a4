"""Running one model across several processes with torch.distributed (tensor parallelism).

    parallel.py   TensorParallel: this process's rank in the group and the collectives the
                  parallel layers call (all-reduce, gather to rank 0)

The parallel layers themselves (column- and row-parallel linears, the vocab-parallel embedding
and LM head) are in `engine/layers/`; with a group of one they are the plain layers.
"""
