"""The CPU KV pool's memory: zeros that come from the OS as they are first touched."""

import gc
import resource

import pytest
import torch

from nanoserve.common.config import EngineConfig
from nanoserve.platforms.cpu.fast_paths import cpu_fast_paths
from nanoserve.platforms.cpu.memory import os_zeroed


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeros_are_zeros_of_the_shape_asked_and_writable(dtype):
    pool = os_zeroed((3, 16, 2, 8), dtype, torch.device("cpu"))
    assert pool.shape == (3, 16, 2, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert torch.count_nonzero(pool.float()) == 0
    gc.collect()  # the mapping lives as long as the tensor, not its local name
    pool[1, 5] = 1.0
    assert pool.float().sum() == 16 and torch.count_nonzero(pool[0].float()) == 0


def test_a_gigabyte_pool_costs_no_memory_until_it_is_written():
    before = resident_bytes()
    pool = os_zeroed((1024, 16, 8, 128, 32), torch.bfloat16, torch.device("cpu"))  # 1 GiB
    assert pool.numel() * 2 == 1 << 30
    assert resident_bytes() - before < 64 << 20  # torch.zeros would have written all of it
    pool[7].fill_(2.0)  # a block written: its pages now exist
    assert pool[7].float().mean() == 2.0 and pool[8].float().abs().sum() == 0


def test_the_cpu_fast_paths_allocate_the_kv_pool_this_way():
    assert cpu_fast_paths(EngineConfig(model="unused")).kv_cache_zeros is os_zeroed
