"""The offline LLM API: vLLM's shapes, stop strings, n, logprobs and errors."""

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    return LLM(str(checkpoint), device="cpu", dtype="float32", max_model_len=256)


def test_generate_accepts_strings_and_token_ids(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    by_text, by_ids = llm.generate(["hello", [104, 101, 108, 108, 111]], params)
    assert by_text.prompt == "hello" and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == [104, 101, 108, 108, 111]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert len(by_text.outputs[0].token_ids) == 8
    assert by_text.outputs[0].finish_reason == "length"
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids)


def test_single_prompt_and_per_prompt_params(llm):
    [only] = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3))
    assert len(only.outputs[0].token_ids) == 3
    short, long = llm.generate(
        ["a", "b"],
        [SamplingParams(max_tokens=2, min_tokens=2), SamplingParams(max_tokens=5, min_tokens=5)],
    )
    assert [len(short.outputs[0].token_ids), len(long.outputs[0].token_ids)] == [2, 5]


def test_stop_string_cuts_text_and_reports_it(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    [free] = llm.generate("xyz", params)
    text = free.outputs[0].text
    stop = text[3:5]  # two tokens of the greedy continuation (byte-level: 1 char = 1 token)
    assert len(stop) == 2
    [cut] = llm.generate("xyz", SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))
    out = cut.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    [kept] = llm.generate(
        "xyz",
        SamplingParams(
            temperature=0.0, max_tokens=12, stop=[stop], include_stop_str_in_output=True
        ),
    )
    assert kept.outputs[0].text == text[: text.index(stop) + 2]


def test_n_completions_are_seeded_per_child(llm):
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=10, min_tokens=10)
    [first] = llm.generate("seed", params)
    [again] = llm.generate("seed", params)
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3


def test_logprobs_hold_chosen_token_and_alternatives(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=3)
    [result] = llm.generate("log", params)
    out = result.outputs[0]
    assert len(out.logprobs) == 4
    for token_id, position in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in position and position[token_id].rank == 1  # greedy: the best token
        assert len(position) == 3
        assert max(p.logprob for p in position.values()) == position[token_id].logprob


def test_bad_parameters_raise_actionable_errors(llm):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        llm.generate([1] * 300)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    assert not llm.engine.has_unfinished_requests()


def test_llm_without_a_model_is_the_demo_model():
    from nanoserve.checkpoint import DEMO_MODEL_DIR

    default, named = LLM(), LLM("nanoserve-demo")
    assert default.engine.model_path == named.engine.model_path == DEMO_MODEL_DIR
    params = SamplingParams(temperature=0, max_tokens=8)
    [a], [b] = default.generate("import os", params), named.generate("import os", params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 8
