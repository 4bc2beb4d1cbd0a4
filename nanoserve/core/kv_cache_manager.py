"""The KV block pool and the per-request block tables, with automatic prefix caching.

The KV cache is one preallocated tensor per layer, cut into `num_blocks` blocks of `block_size`
token slots. This module only does the bookkeeping: which blocks a request owns, which are free,
and which full blocks hold a known prefix that a new request may share.

Invariants (checked by `BlockPool.check_invariants`, which the randomized tests call every step):
- every block is either in use (`ref_count > 0`) or in the free queue, never both;
- a block in the hash table holds exactly the tokens of its hash's prefix, and the table maps
  that hash to it and to no other block;
- a request's block table holds `ceil(num_computed_tokens / block_size)` blocks or more;
- a kept tail is a free block, kept under the hash of the full block before it (a full block
  may be both cached and a kept tail: a request sharing only part of it takes it over).

Prefix caching: a full block is named by a chained hash, `sha256(parent_hash + its tokens)`, so
equal hashes mean equal whole prefixes. Free blocks keep their contents and hash; they are
evicted least-recently-freed first, and only when a new block is needed. A finished request's
partly filled last block, and the block its prompt ended in, are kept as *tails*: a request that
shares only part of such a block (an editor's next keystroke, which drops what the last one
generated) takes it over and computes only what comes after the tokens it shares.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from nanoserve.common.prefix_hash import BlockHash, hash_block_tokens
from nanoserve.core.request import Request


@dataclass
class KVBlock:
    """One block of KV slots: who uses it and, once full and cached, which prefix it holds."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # A free, partly filled block kept as a tail: (hash of the full block before it, the tokens
    # whose keys and values it holds).
    tail: tuple[BlockHash | None, tuple[int, ...]] | None = None


class BlockPool:
    """All KV blocks: the free queue (LRU order) and the table of cached full blocks."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is the least recently freed.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id
        self.tails: dict[BlockHash | None, int] = {}  # hash of the full block before -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take blocks from the head of the free queue, evicting any cached prefix they hold."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self.forget_prefix(block_id)
            self._drop_tail(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Take another reference to cached blocks (a prefix hit); free ones leave the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
                self._drop_tail(block)  # its new owner writes after the tokens it shares
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody uses go to the tail of the queue.
        Callers pass a request's blocks in reverse, so its last blocks (the longest, least
        shareable prefixes) are evicted before its first ones."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than taken"
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def forget_prefix(self, block_id: int) -> None:
        """Evict a block's cached prefix: its slots are about to be rewritten."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Name a full block by its prefix hash so later requests can share it."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return  # already cached here, or another block holds the same prefix
        block.block_hash = block_hash
        self.cached[block_hash] = block_id

    def keep_tail(self, block_id: int, parent: BlockHash | None, tokens: list[int]) -> None:
        """Keep a free, partly filled block findable by the prefix before it (the newest wins)."""
        replaced = self.tails.get(parent)
        if replaced is not None:
            self.blocks[replaced].tail = None
        self.blocks[block_id].tail = (parent, tuple(tokens))
        self.tails[parent] = block_id

    def _drop_tail(self, block: KVBlock) -> None:
        if block.tail is not None:
            del self.tails[block.tail[0]]
            block.tail = None

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (used by tests)."""
        for block in self.blocks:
            is_free = block.block_id in self.free_queue
            assert block.ref_count >= 0
            assert is_free == (block.ref_count == 0), block
            if block.block_hash is not None:
                assert self.cached[block.block_hash] == block.block_id
            if block.tail is not None:
                assert self.tails[block.tail[0]] == block.block_id
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash
        for parent, block_id in self.tails.items():
            tail = self.blocks[block_id].tail
            assert tail is not None and tail[0] == parent and block_id in self.free_queue


class KVCacheManager:
    """Gives requests block tables from a `BlockPool`, reusing cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._block_hashes: dict[str, list[BlockHash]] = {}  # request id -> full-block hashes
        self._num_named_blocks: dict[str, int] = {}  # request id -> blocks already offered
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of those, tokens found in the cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached full blocks at the start of the request's tokens, then the
        kept tail after them that shares the most tokens with the request.

        Returns (block ids, number of tokens they hold), at most `request.max_cached_prefix_tokens`
        tokens: the last token must run through the model to produce logits, and so must prompt
        positions whose logprobs are asked for.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._hashes_for(request)
        max_hit_blocks = request.max_cached_prefix_tokens // self.block_size
        block_ids = []
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        num_tokens = len(block_ids) * self.block_size
        parent = hashes[len(block_ids) - 1] if block_ids else None
        tail_id = self.pool.tails.get(parent)
        if tail_id is None:
            return block_ids, num_tokens
        kept = self.pool.blocks[tail_id].tail[1]  # type: ignore[index]  # a kept tail has one
        wanted = request.all_token_ids[num_tokens : request.max_cached_prefix_tokens]
        num_shared = 0
        while num_shared < min(len(kept), len(wanted)) and kept[num_shared] == wanted[num_shared]:
            num_shared += 1
        if num_shared == 0:
            return block_ids, num_tokens
        return [*block_ids, tail_id], num_tokens + num_shared

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup for the prefix-cache metrics."""
        if self.enable_prefix_caching:
            self.num_prefix_queries += num_tokens
            self.num_prefix_hits += num_hit_tokens

    def can_allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int], num_cached: int = 0
    ) -> bool:
        num_needed = self._num_new_blocks(request, num_new_tokens, cached_blocks, num_cached)
        # Cached blocks that are free now leave the free queue when shared, so count them too.
        num_revived = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        return num_needed + num_revived <= self.pool.num_free_blocks

    def allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int], num_cached: int = 0
    ) -> None:
        """Give the request slots for `num_new_tokens` more tokens after the `num_cached` that
        `cached_blocks` (from `find_cached_prefix`) hold."""
        assert self.can_allocate(request, num_new_tokens, cached_blocks, num_cached)
        num_needed = self._num_new_blocks(request, num_new_tokens, cached_blocks, num_cached)
        self.pool.share(cached_blocks)
        if num_cached % self.block_size:  # a tail, full or not: rewritten after what is shared
            self.pool.forget_prefix(cached_blocks[-1])
        request.block_ids.extend(cached_blocks)
        request.block_ids.extend(self.pool.allocate(num_needed))
        if self.enable_prefix_caching:
            num_known = num_cached + request.num_computed_tokens
            self._cache_full_blocks(request, num_known + num_new_tokens)

    def free(self, request: Request) -> None:
        """Return all of the request's blocks (in reverse, see `BlockPool.free`); the block its
        prompt ended in and its partly filled last block, once free, are kept as tails."""
        self.pool.free(list(reversed(request.block_ids)))
        size = self.block_size
        for index in {(request.num_prompt_tokens - 1) // size, request.num_computed_tokens // size}:
            start = index * size
            tokens = request.all_token_ids[start : request.num_computed_tokens][:size]
            if self.enable_prefix_caching and tokens and index < len(request.block_ids):
                block = self.pool.blocks[request.block_ids[index]]
                parent = self._hashes_for(request)[index - 1] if index else None
                if block.ref_count == 0:  # nobody else writes after its tokens
                    self.pool.keep_tail(block.block_id, parent, tokens)
        request.block_ids = []
        self._num_named_blocks.pop(request.request_id, None)

    def forget(self, request: Request) -> None:
        """Drop the request's hash memo once it is finished."""
        self._block_hashes.pop(request.request_id, None)

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, cached: list[int], num_cached: int
    ) -> int:
        num_tokens = request.num_computed_tokens + num_cached + num_new_tokens
        return max(0, self.num_blocks_needed(num_tokens) - len(request.block_ids) - len(cached))

    def _hashes_for(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended as tokens arrive."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            block_tokens = tokens[i * self.block_size : (i + 1) * self.block_size]
            hashes.append(hash_block_tokens(parent, block_tokens))
        return hashes

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        """Name every block that this step fills, so that later requests can share it.

        A block registered now is written in this same forward pass; a request that hits it in
        this step reads it in the same pass too, after every layer's writes (see attention).
        """
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        start = self._num_named_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes_for(request)
        for i in range(start, num_full):
            self.pool.cache_block(request.block_ids[i], hashes[i])
        self._num_named_blocks[request.request_id] = num_full
