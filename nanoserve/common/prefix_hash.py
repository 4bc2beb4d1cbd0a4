"""Names of prompt prefixes, block by block (torch-free: the KV cache and the front share them).

A full block of `block_size` tokens is named by `sha256(parent's name + its tokens)`, so one
name stands for a whole prefix: equal names mean equal prefixes. The KV cache manager finds
cached blocks by these names; the data-parallel front routes a prompt to the engine that last
saw its longest named prefix.
"""

from __future__ import annotations

import hashlib

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """Chained hash of one full block: equal hashes mean equal whole prefixes."""
    data = (parent_hash or b"") + b"".join(t.to_bytes(4, "little") for t in token_ids)
    return hashlib.sha256(data).digest()


def prefix_hashes(token_ids: list[int], block_size: int, max_blocks: int) -> list[BlockHash]:
    """The names of the first full blocks of `token_ids` (at most `max_blocks`), in order."""
    hashes: list[BlockHash] = []
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
    return hashes
