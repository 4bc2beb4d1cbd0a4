"""Structured output in the worker: per-request grammar matchers and the token masks they give.

    grammars.py   a constraint (JSON schema, regex, choice, grammar) as an llguidance grammar
    grammar.py    one request's matcher, advanced with each accepted token
    manager.py    the grammar backend: matchers compiled off the step loop (once per constraint),
                  one bitmask per step for the constrained rows, filled while the model runs

It enters the core as its grammar backend (`core/grammar.py`); the sampler adds the masks.
"""
