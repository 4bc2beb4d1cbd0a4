"""How deep JSON may nest in the front, checked on its text, without recursion.

Python's `json`, msgspec and pydantic walk nested containers recursively, so how deep they can
go depends on the process's recursion limit (which torch.compile raises, for one). The front
answers the same whatever that limit is: no request body, and no tool call the model writes, is
handed to a recursive parser before its depth is checked here, on the raw text.

MAX_JSON_DEPTH is the limit of serde_json, the parser llguidance reads schemas with (deeper
schemas are refused there anyway); no request an OpenAI client sends comes near it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 128

_STRUCTURE = b'[]{}"'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_QUOTE = ord('"')
_STEP = np.zeros(256, dtype=np.int64)  # each byte's change of depth: +1 opens, -1 closes
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_CHUNK_BYTES = 1 << 20  # the vectorised walk's working arrays stay a few MiB


def is_json_too_deep(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """True if the JSON `text` (well formed or not) opens more than `max_depth` brackets at once.

    Brackets inside strings do not count, as a parser reads them: escaped backslashes are
    dropped, then escaped quotes, so each quote left opens or closes a string. Byte-string
    passes and a vectorised running sum: a 32 MiB body takes a fraction of a second.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    return _deepest(data.translate(None, delete=_NOT_STRUCTURE)) > max_depth


def _deepest(structure: bytes) -> int:
    """The deepest nesting outside strings of a text of brackets and quotes only."""
    deepest, depth, in_string = 0, 0, 0
    for start in range(0, len(structure), _CHUNK_BYTES):
        chunk = np.frombuffer(structure[start : start + _CHUNK_BYTES], dtype=np.uint8)  # [C]
        is_quote = (chunk == _QUOTE).view(np.uint8)  # [C]
        inside = np.bitwise_xor.accumulate(is_quote) ^ in_string  # [C]: 1 within a string
        depths = depth + np.cumsum(np.where(inside == 1, 0, _STEP[chunk]))  # [C]
        deepest, depth, in_string = max(deepest, int(depths.max())), int(depths[-1]), inside[-1]
    return deepest


def loads_bounded(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(text)`, but a ValueError (never a RecursionError) if it nests too deeply."""
    if is_json_too_deep(text, max_depth):
        raise ValueError(f"the JSON text nests deeper than {max_depth} levels")
    return json.loads(text)
