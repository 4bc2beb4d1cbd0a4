"""The core's structured-output plug point: the masks the sampler adds, and an engine built
without a grammar backend."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import FinishReason
from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.core.engine import Engine
from nanoserve.core.grammar import GrammarMasks, NoGrammarBackend, apply_grammar_masks


@pytest.mark.parametrize("rows", [[1], [0, 1, 2]])
def test_apply_grammar_masks_sets_forbidden_tokens_to_minus_infinity(rows: list[int]) -> None:
    logits = torch.randn(3, 70)
    original = logits.clone()
    bias = torch.full((len(rows), 70), float("-inf"))
    bias[:, [5, 65]] = 0.0
    out = apply_grammar_masks(logits, GrammarMasks(rows=rows, bias=bias))
    for row in range(3):
        if row in rows:
            assert torch.isfinite(out[row]).nonzero().flatten().tolist() == [5, 65]
            assert out[row, 5] == original[row, 5] and out[row, 65] == original[row, 65]
        else:
            assert torch.equal(out[row], original[row])


def test_without_a_backend_a_constrained_request_is_refused_with_the_reason(tmp_path) -> None:
    assert "not available" in NoGrammarBackend().reason
    engine = Engine(EngineConfig(model=str(make_tiny_checkpoint(tmp_path)), device="cpu"))
    constraint = StructuredOutputsParams(regex="a+")
    engine.add_request("c", [1, 2], SamplingParams(structured_outputs=constraint))
    engine.add_request("f", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    refused = [d for d in deltas if d.request_id == "c"]
    assert [(d.finish_reason, d.new_token_ids) for d in refused] == [(FinishReason.ABORT, [])]
    assert "structured output is not available" in (refused[0].error or "")
    assert sum(len(d.new_token_ids) for d in deltas if d.request_id == "f") == 2
