"""The CPU KV pool's memory: zeros that come from the OS as they are first touched."""

import gc
import resource

import pytest
import torch

from nanoserve.common.config import EngineConfig
from nanoserve.platforms.cpu.fast_paths import cpu_fast_paths
from nanoserve.platforms.cpu.memory import CHUNK_BYTES, KVPoolPages, os_zeroed


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


def test_the_cpu_fast_paths_allocate_the_kv_pool_this_way_and_fault_it_in_while_idle():
    paths = cpu_fast_paths(EngineConfig(model="unused"))
    pages = paths.kv_cache_zeros.__self__  # type: ignore[attr-defined]
    assert isinstance(pages, KVPoolPages) and paths.idle_work == pages.fault_in


def test_idle_fault_in_maps_the_pool_without_changing_a_byte():
    pages = KVPoolPages()
    cpu = torch.device("cpu")
    caches = [pages.zeros((512, 16, 8, 128), torch.bfloat16, cpu) for _ in range(4)]  # 16 MiB
    caches[1][3].fill_(1.5)  # blocks already in use: their keys must survive
    caches[2][500].fill_(-2.0)
    before = resident_bytes()
    assert pages.fault_in(budget_s=0.0)  # one chunk of one mapping, more remain
    assert (pages.offset, pages.index) == (0, 1)
    for _ in range(3):
        pages.fault_in(budget_s=0.0)
    assert (pages.offset, pages.index) == (CHUNK_BYTES, 0)  # every mapping's first chunk
    while pages.fault_in(budget_s=0.0):
        pass
    assert pages.is_done and not pages.fault_in()
    assert resident_bytes() - before > 48 << 20  # the 64 MiB, less what was written before
    assert caches[1][3].float().eq(1.5).all() and caches[2][500].float().eq(-2.0).all()
    assert sum(torch.count_nonzero(c.float()) for c in caches) == 2 * 16 * 8 * 128


def test_an_engine_faults_its_pool_in_when_asked(tmp_path):
    from tiny_checkpoints import make_tiny_checkpoint

    from nanoserve.engine_setup import build_engine

    config = EngineConfig(model=str(make_tiny_checkpoint(tmp_path)), device="cpu")
    engine = build_engine(config)
    before = resident_bytes()
    slices = 1
    while engine.idle_work():
        slices += 1
    pool_bytes = engine.kv_cache.num_blocks * engine.kv_cache.block_bytes
    assert resident_bytes() - before > pool_bytes // 2 and slices >= 1
