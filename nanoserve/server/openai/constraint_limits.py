"""How much of a structured-output constraint the front hands to the grammar engine.

The worker probes every new constraint in a child process (a crash there costs one request and
llguidance's refusals come back as 400s), so these bounds are not what keeps the server up:
they say no early and clearly, in the front, before anything is built from the constraint, and
keep hostile constraints from holding the worker's compile threads. Each is llguidance's own
limit where it has one:

- MAX_CONSTRAINT_BYTES (512 KiB): a schema's JSON, a regex, a grammar or a choice list. The
  slowest grammar under it we know of (1,000 Lark rules of 29 alternatives each, the
  attacker of benchmarks/grammar_attacker.py) compiles well inside the worker's 10 s deadline;
  llguidance's JSON compiler refuses schemas about twice this size anyway ("schema too large").
- MAX_SCHEMA_DEPTH (128): how deep a schema nests with its `$ref`s followed. 128 is the depth
  serde_json, llguidance's parser, allows the schema document itself; llguidance resolves
  `$ref` chains recursively, and a chain of a thousand nested links overflows its stack.
- MAX_ALTERNATIVES (2,000): the branches of one `anyOf` or `oneOf`, and the tools a
  `tool_choice: "required"` chooses from (each an `anyOf` branch): llguidance's
  `max_items_in_row`, since every branch is an item of the parser row where it starts.
- MAX_GRAMMAR_RULES (1,000): rule definitions in a Lark or GBNF grammar; 3,000 chained rules
  overflow llguidance's stack, and real grammars (SQL, a programming language) have hundreds.
- MAX_REPEAT_COUNT (999,999): a repetition count (`{n}`, `{n,m}`, Lark's `~ n`) in a regex, a
  schema's `pattern` or anywhere in a grammar's text (its `%json` schemas' patterns are string
  literals). llguidance's lexer starts with 1,000,000 units of fuel and each repetition costs
  at least one, so a count of a million can never compile.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from nanoserve.common.sampling_params import StructuredOutputsParams
from nanoserve.server.errors import APIError
from nanoserve.server.json_depth import is_json_too_deep

MAX_CONSTRAINT_BYTES = 512 * 1024
MAX_SCHEMA_DEPTH = 128
MAX_ALTERNATIVES = 2000
MAX_GRAMMAR_RULES = 1000
MAX_REPEAT_COUNT = 999_999

# A rule or terminal definition at the start of a line: Lark's `name:`, `?name:`, `NAME.2:`,
# GBNF's `name ::=`.
_RULE_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.M)
# A repetition count: `{n}`, `{n,}`, `{n,m}` (regex, GBNF) or `~ n`, `~ n..m` (Lark).
_REPEAT_COUNTS = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_BRANCHING_KEYS = ("anyOf", "oneOf")


def check_constraint(constraint: StructuredOutputsParams, param: str) -> None:
    """400 naming `param` if `constraint` is over a limit the grammar engine could not take."""
    kind, value = constraint.kind, getattr(constraint, constraint.kind)
    if kind == "json_object":
        return
    text = value if isinstance(value, str) else msgspec.json.encode(value)
    num_bytes = len(text.encode()) if isinstance(text, str) else len(text)
    if num_bytes > MAX_CONSTRAINT_BYTES:
        raise APIError(
            f"{param}: the {kind} is {num_bytes} bytes; a constraint may be at most "
            f"{MAX_CONSTRAINT_BYTES} bytes (the grammar engine compiles larger ones for seconds "
            f"or refuses them)",
            400,
            param,
        )
    if kind == "json":
        check_schema(_schema_of(value, param), param)
    elif kind in ("regex", "grammar"):
        _check_repeat_counts(value, kind, param)
    if kind == "grammar":
        _check_rules(value, param)


def check_schema(schema: Any, param: str) -> None:
    """A JSON schema's depth with its `$ref`s followed, its branches and its patterns."""
    if _depth_with_refs(schema) > MAX_SCHEMA_DEPTH:
        raise APIError(
            f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels with its $refs "
            "followed; flatten it or shorten its chains of $refs",
            400,
            param,
        )
    for node in _containers(schema):
        if not isinstance(node, dict):
            continue
        for key in _BRANCHING_KEYS:
            branches = node.get(key)
            if isinstance(branches, list) and len(branches) > MAX_ALTERNATIVES:
                raise APIError(
                    f"{param}: an {key} of the schema has {len(branches)} branches; the grammar "
                    f"engine takes at most {MAX_ALTERNATIVES} (an enum of values has no limit)",
                    400,
                    param,
                )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            _check_repeat_counts(pattern, "schema's pattern", param)


def _schema_of(value: str | dict[str, Any], param: str) -> Any:
    """The schema as JSON values; a text that is not JSON is left for the worker to refuse."""
    if not isinstance(value, str):
        return value
    if is_json_too_deep(value, MAX_SCHEMA_DEPTH):
        raise APIError(
            f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", 400, param
        )
    try:
        return json.loads(value)
    except ValueError:
        return None


def _containers(value: Any) -> list[Any]:
    """Every list and dict inside `value` (itself included), without recursion."""
    found, stack = [], [value]
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list)):
            found.append(node)
            stack.extend(node.values() if isinstance(node, dict) else node)
    return found


def _depth_with_refs(schema: Any) -> int:
    """How deep `schema` nests when each local `$ref` is followed into what it names (a `$ref`
    back into its own path, a recursive schema, ends there). Iterative, each node once."""
    depth: dict[int, int] = {}  # id(node) -> its depth, once every child's is known
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, (dict, list)) or (not children_done and id(node) in depth):
            continue
        children = _children_with_ref(node, schema)
        if children_done:
            on_path.discard(id(node))
            depth[id(node)] = 1 + max((depth.get(id(c), 0) for c in children), default=0)
            if depth[id(node)] > MAX_SCHEMA_DEPTH:
                return depth[id(node)]  # deep enough to refuse: no need to finish
        elif id(node) not in on_path:
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in on_path)
    return depth.get(id(schema), 0)


def _children_with_ref(node: dict[str, Any] | list[Any], root: Any) -> list[Any]:
    """A node's containers, and for `{"$ref": "#/..."}` the node the pointer names."""
    values = node.values() if isinstance(node, dict) else node
    children = [v for v in values if isinstance(v, (dict, list))]
    ref = node.get("$ref") if isinstance(node, dict) else None
    if isinstance(ref, str) and ref.startswith("#"):
        target = _resolve_pointer(root, ref[1:])
        if isinstance(target, (dict, list)):
            children.append(target)
    return children


def _resolve_pointer(root: Any, pointer: str) -> Any:
    """What a JSON pointer (`/$defs/a`, RFC 6901) names in `root`; None if nothing."""
    node = root
    for part in pointer.split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_repeat_counts(text: str, what: str, param: str) -> None:
    for match in _REPEAT_COUNTS.finditer(text):
        counts = [int(group) for group in match.groups() if group]
        if counts and max(counts) > MAX_REPEAT_COUNT:
            raise APIError(
                f"{param}: the {what} repeats {max(counts)} times ({match.group(0)!r}); the "
                f"grammar engine can build at most {MAX_REPEAT_COUNT} repetitions",
                400,
                param,
            )


def _check_rules(grammar: str, param: str) -> None:
    num_rules = len(_RULE_DEFINITION.findall(grammar))
    if num_rules > MAX_GRAMMAR_RULES:
        raise APIError(
            f"{param}: the grammar defines {num_rules} rules; the grammar engine takes at most "
            f"{MAX_GRAMMAR_RULES}",
            400,
            param,
        )
