"""Structured-output constraints as llguidance grammars.

A request's `StructuredOutputsParams` becomes one llguidance grammar here, in the worker only
(`manager.py` builds the request's token matcher from `grammar_for`, once per constraint): a
bad schema, regex or grammar fails there, and the front answers 400 with the message. The front
never runs the grammar engine. llguidance was chosen over xgrammar by measurement (see
benchmarks/RESULTS.md).

JSON is written without free whitespace, with json.dumps' separators (`{"a": 1, "b": [2]}`):
a model cannot wander in whitespace, and what it writes reads like OpenAI's JSON.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

from nanoserve.common.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_for(constraint: StructuredOutputsParams) -> str:
    """The llguidance grammar of `constraint` (validated as the matcher is built from it)."""
    kind = constraint.kind
    try:
        if kind == "json" or kind == "json_object":
            schema = ANY_JSON_OBJECT if constraint.json is None else constraint.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind == "regex":
            assert constraint.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
        if kind == "choice":
            assert constraint.choice is not None
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice)
            # One terminal (a lexeme the lexer matches), not one rule per choice: a rule's
            # alternatives all share a parser row, which llguidance caps at 2,000 items.
            return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")
        assert constraint.grammar is not None
        return llguidance.grammar_from("grammar", constraint.grammar)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid structured output {kind}: {e}") from None
