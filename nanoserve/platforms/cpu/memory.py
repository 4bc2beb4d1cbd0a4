"""The CPU's KV pool memory: zeros the OS hands out page by page, faulted in while idle.

`torch.zeros` on CPU writes every byte at once: seconds of every start for a pool of gigabytes.
An anonymous mapping is zero by definition, and the OS zeroes each page when it is first
written (huge pages where it can), so a pool costs nothing until its blocks are used.

Those first writes are not free either: a prompt's keys and values landing on pages never
touched pay a page fault per page, inside the step (on a virtual machine, where the host backs
each page on its first touch, a 1,500-token prompt of the 0.6B shape spent a sixth of its
prefill there). `KVPoolPages` faults the pool in ahead of use while the worker has nothing to
run: `madvise(MADV_POPULATE_WRITE)` maps each page writable without writing to it (so blocks in
use keep their contents), a few huge pages per call, lowest blocks first (the order the block
pool hands out never-used blocks).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import time

import torch

logger = logging.getLogger("nanoserve.cpu_memory")

MADV_POPULATE_WRITE = 23  # Linux 5.14+
CHUNK_BYTES = 2 << 20  # one huge page of each mapping per madvise call
IDLE_SLICE_S = 0.005  # how long one call of `fault_in` works (past its first chunk)


def os_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of `shape` in an anonymous mapping (CPU only); the tensor keeps the mapping."""
    assert device.type == "cpu", f"os_zeroed allocates CPU memory, not {device}"
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype)[:count].view(shape)


class KVPoolPages:
    """The KV pool's mappings (`zeros` allocates them) and how far they are faulted in."""

    def __init__(self) -> None:
        self.mappings: list[tuple[int, int]] = []  # (address, bytes) of each layer's K or V
        self.offset = 0  # bytes of every mapping faulted in so far (then the next chunk's)
        self.index = 0  # the mapping whose chunk at `offset` is next
        self.is_done = False
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise  # releases the GIL
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def zeros(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """`os_zeroed`, remembered for `fault_in`."""
        tensor = os_zeroed(shape, dtype, device)
        self.mappings.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        return tensor

    def fault_in(self, budget_s: float = IDLE_SLICE_S) -> bool:
        """Fault in the next chunk (of one mapping), and more until `budget_s` has passed;
        True while pages remain. Each mapping's first chunk, then each one's second, ..."""
        started = time.perf_counter()
        longest = max((size for _, size in self.mappings), default=0)
        self.is_done = self.is_done or self.offset >= longest
        while not self.is_done:
            address, size = self.mappings[self.index]
            length = min(CHUNK_BYTES, size - self.offset)
            if length > 0 and not self._populate(address + self.offset, length):
                self.is_done = True
                return False
            self.index += 1
            if self.index == len(self.mappings):  # the next chunk of every mapping
                self.index, self.offset = 0, self.offset + CHUNK_BYTES
                self.is_done = self.offset >= longest
            if time.perf_counter() - started >= budget_s:
                break
        return not self.is_done

    def _populate(self, address: int, length: int) -> bool:
        if self._madvise(address, length, MADV_POPULATE_WRITE) == 0:
            return True
        logger.info(
            "the KV pool's pages are faulted in as blocks are first used (madvise: %s)",
            ctypes.get_errno(),
        )
        return False
