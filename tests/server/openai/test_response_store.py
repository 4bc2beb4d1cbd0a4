"""The stored responses: bounded in count and bytes, least recently used out first."""

from __future__ import annotations

import gc
import tracemalloc

from nanoserve.server.openai.response_store import ResponseStore


def put(store: ResponseStore, response_id: str, text: str = "") -> None:
    store.put({"id": response_id, "text": text}, [{"role": "user", "content": text}])


def test_count_limit_evicts_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=2)
    put(store, "a")
    put(store, "b")
    assert store.get("a") is not None  # a is now the most recently used
    put(store, "c")
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_byte_limit_evicts_until_it_fits_and_skips_what_never_could() -> None:
    store = ResponseStore(max_bytes=500)  # each entry here: ~180-260 bytes
    put(store, "a", "x" * 60)
    put(store, "b", "x" * 60)
    assert len(store) == 2 and store.num_bytes <= 500
    put(store, "c", "x" * 100)
    assert store.get("a") is None and len(store) == 2 and store.num_bytes <= 500
    put(store, "huge", "x" * 400)
    assert store.get("huge") is None and len(store) == 2


def test_delete_and_replace_keep_the_byte_count() -> None:
    store = ResponseStore()
    put(store, "a", "hello")
    size = store.num_bytes
    put(store, "a", "hello")
    assert store.num_bytes == size and len(store) == 1
    assert store.delete("a") and not store.delete("a")
    assert store.num_bytes == 0 and store.get("a") is None


def test_the_byte_count_is_the_memory_the_store_holds() -> None:
    # A response's objects (a dict per entry, a str per key and value) take several times their
    # JSON size: the store holds its responses encoded, so the bytes counted are the bytes held.
    store = ResponseStore()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        metadata = {f"k{i}": f"v{i}" for i in range(100_000)}
        store.put({"id": "a", "metadata": metadata}, [{"role": "user", "content": "hi"}])
        del metadata
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.num_bytes <= held <= 1.2 * store.num_bytes + 4096, (held, store.num_bytes)
    entry = store.get("a")
    assert entry is not None and entry.response["metadata"]["k99999"] == "v99999"
    assert entry.messages == [{"role": "user", "content": "hi"}]
