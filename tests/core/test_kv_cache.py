"""The KV pool's memory: zeros on CPU come from the OS as they are first touched."""

import gc
import resource

import pytest
import torch

from nanoserve.core.kv_cache import zeros


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeros_are_zeros_of_the_shape_asked_and_writable(dtype):
    pool = zeros((3, 16, 2, 8), dtype, torch.device("cpu"))
    assert pool.shape == (3, 16, 2, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert torch.count_nonzero(pool.float()) == 0
    gc.collect()  # the mapping lives as long as the tensor, not its local name
    pool[1, 5] = 1.0
    assert pool.float().sum() == 16 and torch.count_nonzero(pool[0].float()) == 0


def test_a_gigabyte_pool_costs_no_memory_until_it_is_written():
    before = resident_bytes()
    pool = zeros((1024, 16, 8, 128, 32), torch.bfloat16, torch.device("cpu"))  # 1 GiB
    assert pool.numel() * 2 == 1 << 30
    assert resident_bytes() - before < 64 << 20  # torch.zeros would have written all of it
    pool[7].fill_(2.0)  # a block written: its pages now exist
    assert pool[7].float().mean() == 2.0 and pool[8].float().abs().sum() == 0
