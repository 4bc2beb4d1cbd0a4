"""Structured output in the worker: per-request grammar matchers and the token masks they give.

`grammar.py` holds one request's matcher (advanced with each accepted token); `manager.py`
builds matchers off the step loop, fills one bitmask per step for the constrained rows and
applies it to the logits before sampling.
"""
