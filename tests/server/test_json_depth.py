"""The front's JSON nesting bound, on text: exact against a recursive count, strings ignored,
the same whatever the recursion limit, and quick on the largest body."""

from __future__ import annotations

import json
import random
import sys
import time

import pytest

from nanoserve.server.json_depth import MAX_JSON_DEPTH, is_json_too_deep, loads_bounded


def depth_of(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


def random_value(rng: random.Random, levels: int) -> object:
    """Nested lists and objects whose strings hold brackets, quotes and backslashes."""
    if levels == 0 or rng.random() < 0.3:
        return rng.choice(['a[\\"', "]}\\\\", 1, "x[{", '\\"[', "\u00e9]"])
    if rng.random() < 0.5:
        return [random_value(rng, levels - 1) for _ in range(rng.randint(0, 3))]
    return {f'k[{i}"\\': random_value(rng, levels - 1) for i in range(rng.randint(0, 3))}


def test_the_depth_is_exact_and_brackets_in_strings_do_not_count() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        value = random_value(rng, rng.randint(1, 10))
        text, depth = json.dumps(value), depth_of(value)
        for limit in range(12):
            assert is_json_too_deep(text, limit) == (depth > limit), (text, limit)
            assert is_json_too_deep(text.encode(), limit) == (depth > limit)


def test_the_bound_is_max_json_depth() -> None:
    at_the_bound = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert not is_json_too_deep(at_the_bound)
    assert is_json_too_deep(f"[{at_the_bound}]")
    assert is_json_too_deep("[" * 10_000)  # cut off: what is open counts
    assert not is_json_too_deep(json.dumps(["[" * 10_000]))  # text


@pytest.mark.parametrize("recursion_limit", [200, 1000, 50_000])
def test_loads_bounded_never_depends_on_the_recursion_limit(recursion_limit: int) -> None:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit)
    try:
        for text in ("[" * 5000, "[" * 5000 + "]" * 5000, '{"a": ' * 900 + "1" + "}" * 900):
            with pytest.raises(ValueError, match=f"deeper than {MAX_JSON_DEPTH}"):
                loads_bounded(text)
        assert loads_bounded('{"a": [1, {"b": "[[["}]}') == {"a": [1, {"b": "[[["}]}
    finally:
        sys.setrecursionlimit(old)


def test_the_largest_body_is_checked_quickly() -> None:
    bodies = [
        b"[]" * (16 << 20),  # 32 MiB of brackets, shallow
        json.dumps([{"role": "user", "content": ""}] * 1_000_000).encode(),
        b'["' + b'\\"[' * (10 << 20) + b'"]',
    ]
    for body in bodies:
        started = time.perf_counter()
        assert not is_json_too_deep(body)
        assert time.perf_counter() - started < 5  # about 0.3 s here; far slower is broken
