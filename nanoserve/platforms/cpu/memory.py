"""The CPU's KV pool memory: zeros the OS hands out page by page.

`torch.zeros` on CPU writes every byte at once: seconds of every start for a pool of gigabytes.
An anonymous mapping is zero by definition, and the OS zeroes each page when it is first
written (huge pages where it can), so a pool costs nothing until its blocks are used.
"""

from __future__ import annotations

import math
import mmap

import torch


def os_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of `shape` in an anonymous mapping (CPU only); the tensor keeps the mapping."""
    assert device.type == "cpu", f"os_zeroed allocates CPU memory, not {device}"
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype)[:count].view(shape)
