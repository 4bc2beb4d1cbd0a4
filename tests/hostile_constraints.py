"""Hostile structured-output and tool constraints, written once for every test that sends them:
the grammar engine's limit tests, the sandbox's crash tests, the server's hostile corpus and its
property-based fuzz (`ISSUE_CASES`: the hardening issue's cases, each with its expected answer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def ref_chain(num_refs: int) -> dict:
    """A schema whose $defs chain d0 -> d1 -> ... nests an object per link (llguidance 1.9
    overflows its stack compiling a thousand of them)."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(num_refs)
    }
    defs[f"d{num_refs}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(num_rules: int) -> str:
    """A Lark grammar of rules each naming the next (3,000 overflow llguidance's stack)."""
    rules = "\n".join(f'r{i}: "a" r{i + 1}' for i in range(num_rules))
    return f'start: r0\n{rules}\nr{num_rules}: "a"'


def slow_grammar() -> str:
    """About 800 KB of Lark: 1,000 rules of 50 alternatives each, the slowest compile the
    front's bounds let through that we know of (seconds)."""
    rules = "\n".join(
        f"r{i}: " + " | ".join(f'"w{i}_{j}" r{(i + 1) % 1000}' for j in range(50))
        for i in range(1000)
    )
    return f"start: r0\n{rules}"


# Arguments that may nest without end: `[` forced by logit_bias nests them past MAX_JSON_DEPTH.
ENDLESS_LISTS = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/list"}},
    "required": ["a"],
    "$defs": {"list": {"type": "array", "items": {"$ref": "#/$defs/list"}}},
}


def deep_named_call(max_tokens: int) -> dict[str, Any]:
    """A chat body whose named tool call nests one list deeper per token, until max_tokens."""
    return {
        "messages": USER,
        "tools": [{"type": "function", "function": {"name": "nest", "parameters": ENDLESS_LISTS}}],
        "tool_choice": {"type": "function", "function": {"name": "nest"}},
        "logit_bias": {str(ord("[")): 100},
        "max_tokens": max_tokens,
    }


def deep_sent_arguments(levels: int) -> list[dict[str, Any]]:
    """Chat messages whose earlier assistant turn called a tool with `levels`-deep arguments."""
    arguments = "[" * levels + "]" * levels
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]


@dataclass(frozen=True)
class HostileCase:
    """A request and its expected answer: the status, and for a 400 its param and words."""

    name: str
    path: str
    body: dict[str, Any]
    status: int
    param: str | None = None
    words: str = ""


def _issue_cases() -> list[HostileCase]:
    many_tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2001)]
    schema_chain = {"type": "json_schema", "json_schema": {"schema": ref_chain(1000)}}
    choices = [f"c{i}" for i in range(2001)]
    required = {"messages": USER, "tools": many_tools, "tool_choice": "required"}
    return [
        HostileCase("tool_choice required, 2,001 tools", CHAT, required, 400, "tools", "2001"),
        HostileCase(
            "a $defs chain of 1,000 links",
            CHAT,
            {"messages": USER, "response_format": schema_chain},
            400,
            "response_format",
            "$refs",
        ),
        HostileCase(
            "regex a{1000000}",
            CHAT,
            {"messages": USER, "structured_outputs": {"regex": "a{1000000}"}},
            400,
            "structured_outputs",
            "repeats",
        ),
        HostileCase(
            "3,000 chained Lark rules",
            COMPLETIONS,
            {"prompt": "x", "guided_grammar": rule_chain(3000)},
            400,
            "guided_grammar",
            "rules",
        ),
        HostileCase(
            "a choice of 2,001 entries", COMPLETIONS, {"prompt": "x", "guided_choice": choices}, 200
        ),
        HostileCase("named tool arguments 200 lists deep", CHAT, deep_named_call(200), 200),
        HostileCase(  # rendered whole (2,000 brackets of text): longer than the context
            "sent tool arguments 1,000 lists deep",
            CHAT,
            {"messages": deep_sent_arguments(1000)},
            400,
            "messages",
            "input tokens",
        ),
    ]


# The hardening issue's cases; each asks for at most 4 tokens unless its point is a longer output.
ISSUE_CASES = [
    dataclasses.replace(case, body={"max_tokens": 4, **case.body}) for case in _issue_cases()
]
