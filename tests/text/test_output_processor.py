"""The output processor reads a delta of several tokens as one token at a time would."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.common.protocol import RequestDelta, TokenLogprobs
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.text.byte_tokenizer import save_byte_level_tokenizer
from nanoserve.text.output_processor import OutputProcessor
from nanoserve.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    directory: Path = tmp_path_factory.mktemp("bytes")
    save_byte_level_tokenizer(directory)
    return load_tokenizer(directory)


def test_a_delta_of_several_tokens_ends_at_the_one_completing_a_stop_string(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=20, stop=["cd"], logprobs=0)
    [request] = processor.add_request("r", [1, 2], params)
    tokens = list(b"abcdef")  # one delta, as a verify step gives: the stop ends after "d"
    entries = [TokenLogprobs(t, -0.5, 1, [], []) for t in tokens]
    update = processor.process(RequestDelta(request.request_id, tokens, logprobs=entries))
    assert update is not None and update.needs_abort
    assert update.choice.text == "ab" and update.choice.finish_reason == "stop"
    assert update.choice.token_ids == list(b"abcd") and len(update.choice.logprobs) == 4


def test_without_stop_strings_a_delta_is_kept_whole(tokenizer):
    processor = OutputProcessor(tokenizer)
    [request] = processor.add_request("r", [1], SamplingParams(temperature=0, max_tokens=20))
    update = processor.process(RequestDelta(request.request_id, list(b"abcdef")))
    assert update is not None and update.choice.token_ids == list(b"abcdef")
    assert update.text == "abcdef"
