"""Suffix decoding's tries from the CPU kernels (`csrc/suffix_trie.cpp`).

`spec_decode/suffix.py` counts every substring of up to 24 tokens in Python, ~0.25 µs a node and
24 nodes a token: a request's own trie over a 600-token prompt was ~3 ms, each finished output
~2 ms more for the global trie, and a draft's walks tens of µs a step, a share of a small
model's millisecond step. The kernels' `GrowingSuffixTrie` and `SuffixTrie` keep the same counts
and give the same drafts (tested against the Python tries), in C++.
"""

from __future__ import annotations

from nanoserve.platforms.cpu.kernels import load_cpu_kernels
from nanoserve.spec_decode.suffix import TrieKinds


def cpu_suffix_tries() -> TrieKinds | None:
    """The kernels' tries, or None where the kernels are not built (Python's then)."""
    kernels = load_cpu_kernels()
    if kernels is None:
        return None
    return TrieKinds(own=kernels.GrowingSuffixTrie, shared=kernels.SuffixTrie)
