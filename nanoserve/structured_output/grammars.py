"""Structured-output constraints as llguidance grammars.

A request's `StructuredOutputsParams` becomes one llguidance grammar here, in the worker only
(`manager.py` builds the request's token matcher from `grammar_for`, once per constraint): a
bad schema, regex or grammar fails there, and the front answers 400 with the message. The front
never runs the grammar engine. llguidance was chosen over xgrammar by measurement (see
benchmarks/RESULTS.md).

JSON is written without free whitespace, with json.dumps' separators (`{"a": 1, "b": [2]}`):
a model cannot wander in whitespace, and what it writes reads like OpenAI's JSON. An object
schema that lists its properties and says nothing of others allows no others
(`closed_objects`): vLLM's default engine (xgrammar, in its strict mode) reads schemas so, and a
small model given `{"properties": {"a": ...}}` would otherwise go on writing keys of its own.
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

# Where a JSON schema holds other schemas: maps of them, lists of them, or one (or, for
# `items` in older drafts, a list).
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
ITEM_SCHEMAS = ("items", "additionalItems", "unevaluatedItems", "contains")
OTHER_PROPERTIES = ("additionalProperties", "unevaluatedProperties")  # what others may be
KEY_AND_CONDITION_SCHEMAS = ("propertyNames", "not", "if", "then", "else")
SUBSCHEMAS = ITEM_SCHEMAS + OTHER_PROPERTIES + KEY_AND_CONDITION_SCHEMAS


def grammar_for(constraint: StructuredOutputsParams) -> str:
    """The llguidance grammar of `constraint` (validated as the matcher is built from it)."""
    kind = constraint.kind
    try:
        if kind == "json" or kind == "json_object":
            schema = constraint.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            schema = ANY_JSON_OBJECT if schema is None else closed_objects(schema)
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


def closed_objects(schema: Any, may_close: bool = True) -> Any:
    """A copy of JSON schema `schema` in which every object schema that names properties
    (`properties` or `patternProperties`) and says nothing of others (no `additionalProperties`
    or `unevaluatedProperties`) allows no others. `allOf`'s parts stay open themselves (two parts
    naming different properties, each closed, could never both hold); what they hold is closed.
    Only schema positions are walked: an `enum` or `const` value is data, kept as it is."""
    if not isinstance(schema, dict):
        return schema  # true, false, or not a schema (llguidance says so)
    closed = dict(schema)
    for key in SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(part) for name, part in closed[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(part, key != "allOf") for part in closed[key]]
    for key in SUBSCHEMAS:
        if key in closed:
            part = closed[key]
            is_list = isinstance(part, list)  # `items` as a list, in older drafts
            closed[key] = [closed_objects(p) for p in part] if is_list else closed_objects(part)
    names_properties = "properties" in closed or "patternProperties" in closed
    says_of_others = any(key in closed for key in OTHER_PROPERTIES)
    if may_close and names_properties and not says_of_others:
        closed["additionalProperties"] = False
    return closed
