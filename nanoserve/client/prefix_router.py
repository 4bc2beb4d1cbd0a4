"""Which data-parallel engine serves a prompt: the one likely to hold its prefix in cache.

Each engine has its own KV cache, so a prompt sent where its prefix was computed before skips
that prefill. The router remembers, for the first full blocks of every prompt it routed, which
engine got it (a bounded LRU table of prefix names, `prefix_hash.py`). A new prompt goes to the
engine that holds its longest remembered prefix, unless that engine is not ready or has
`max_imbalance` more requests in flight than the least loaded one; otherwise it goes to the
least loaded ready engine (taking turns among equally loaded ones, so that new prefixes spread
over the engines even when requests come one at a time).
"""

from __future__ import annotations

from collections import OrderedDict

from nanoserve.common.prefix_hash import BlockHash, prefix_hashes

# How a request's engine is chosen: by cached prefix (the default), by load alone, or in turn
# (a baseline for benchmarks and tests).
ROUTINGS = ("prefix", "least-loaded", "round-robin")
MAX_BLOCKS_PER_PROMPT = 64  # the first 64 blocks (1,024 tokens at 16) name a prefix enough
MAX_ENTRIES = 200_000  # ~12 MB of names and engine ids


class PrefixRouter:
    """Remembers which engine saw which prefix; picks an engine for each new prompt."""

    def __init__(
        self,
        num_engines: int,
        block_size: int,
        max_imbalance: int = 8,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self.num_engines = num_engines
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.max_entries = max_entries
        self._owners: OrderedDict[BlockHash, int] = OrderedDict()  # prefix name -> engine
        self._turn = 0  # breaks ties between equally loaded engines

    def route(self, prompt_token_ids: list[int], loads: list[int], ready: list[bool]) -> int:
        """Choose this prompt's engine and remember that it now holds the prompt's prefixes
        (the prompt's block names are computed once for both)."""
        hashes = self._names(prompt_token_ids)
        engine = self._choose(hashes, loads, ready)
        self._record(hashes, engine)
        return engine

    def choose(self, prompt_token_ids: list[int], loads: list[int], ready: list[bool]) -> int:
        """The engine for this prompt, given each engine's requests in flight and readiness."""
        hashes = self._names(prompt_token_ids)
        return self._choose(hashes, loads, ready)

    def record(self, prompt_token_ids: list[int], engine: int) -> None:
        """Remember that `engine` now holds this prompt's prefixes."""
        self._record(self._names(prompt_token_ids), engine)

    def least_loaded(self, loads: list[int], ready: list[bool]) -> int:
        """The ready engine with the fewest requests in flight, taking turns among equals."""
        candidates = [i for i in range(self.num_engines) if ready[i]]
        if not candidates:
            raise RuntimeError("no engine is ready")
        least_load = min(loads[i] for i in candidates)
        least_loaded = [i for i in candidates if loads[i] == least_load]
        self._turn += 1
        return least_loaded[self._turn % len(least_loaded)]

    def _names(self, prompt_token_ids: list[int]) -> list[BlockHash]:
        return prefix_hashes(prompt_token_ids, self.block_size, MAX_BLOCKS_PER_PROMPT)

    def _choose(self, hashes: list[BlockHash], loads: list[int], ready: list[bool]) -> int:
        fallback = self.least_loaded(loads, ready)
        for block_hash in reversed(hashes):  # the longest remembered prefix first
            owner = self._owners.get(block_hash)
            if owner is not None and ready[owner]:
                if loads[owner] - loads[fallback] <= self.max_imbalance:
                    return owner
                break
        return fallback

    def _record(self, hashes: list[BlockHash], engine: int) -> None:
        for block_hash in hashes:
            self._owners[block_hash] = engine
            self._owners.move_to_end(block_hash)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def forget_engine(self, engine: int) -> None:
        """An engine restarted with an empty cache: it holds no prefix any more."""
        for block_hash in [h for h, owner in self._owners.items() if owner == engine]:
            del self._owners[block_hash]
