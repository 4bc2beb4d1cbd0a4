"""The offline LLM API: vLLM's shapes, stop strings, n, logprobs and errors."""

import pytest
import torch
import transformers
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def llm(checkpoint):
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


def test_prompt_logprobs_in_vllm_shape(llm, checkpoint):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=2, n=2, prompt_logprobs=2)
    scored, unscored = llm.generate(["score me", "plain"], [params, SamplingParams(max_tokens=1)])
    assert unscored.prompt_logprobs is None
    prompt = scored.prompt_token_ids
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)
    assert len(scored.prompt_logprobs) == len(prompt) and scored.prompt_logprobs[0] is None
    for position, entries in enumerate(scored.prompt_logprobs[1:]):
        token_id = prompt[position + 1]
        row = reference[position]
        assert entries[token_id].logprob == pytest.approx(row[token_id].item(), abs=1e-5)
        assert entries[token_id].decoded_token == llm.tokenizer.decode([token_id])
        assert entries[token_id].rank == int((row >= row[token_id]).sum())
        top_ids = row.topk(2).indices.tolist()
        assert set(entries) == {token_id, *top_ids}
        assert [entries[t].rank for t in top_ids] == [1, 2]


def test_max_tokens_zero_returns_the_scored_prompt_only(llm):
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    [result] = llm.generate("only the prompt", params)
    assert len(result.prompt_logprobs) == len("only the prompt")
    [output] = result.outputs
    assert (output.text, output.token_ids, output.finish_reason) == ("", [], "length")
    assert not llm.engine.has_unfinished_requests()


def test_bad_parameters_raise_actionable_errors(llm):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"max_tokens must be ≥ 1 \(or 0 to run the prompt"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        llm.generate([1] * 300)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    assert not llm.engine.has_unfinished_requests()


def test_llm_without_a_model_is_the_demo_model():
    from nanoserve.common.checkpoint import DEMO_MODEL_DIR

    default, named = LLM(), LLM("nanoserve-demo")
    assert default.engine.model_path == named.engine.model_path == DEMO_MODEL_DIR
    params = SamplingParams(temperature=0, max_tokens=8)
    [a], [b] = default.generate("import os", params), named.generate("import os", params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 8


def test_generate_without_params_uses_the_model_generation_config(checkpoint, tmp_path):
    import json
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint, model_dir)
    config_path = model_dir / "generation_config.json"
    defaults = {"temperature": 0.0, "repetition_penalty": 1.8, "max_new_tokens": 6}
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **defaults}))
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256)
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, repetition_penalty=1.8, max_tokens=6
    )
    explicit = SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=6, min_tokens=6)
    [by_default], [by_hand] = llm.generate("hello"), llm.generate("hello", explicit)
    assert len(by_default.outputs[0].token_ids) <= 6
    assert (
        by_default.outputs[0].token_ids
        == by_hand.outputs[0].token_ids[: len(by_default.outputs[0].token_ids)]
    )
    ours = LLM(str(model_dir), generation_config="vllm", device="cpu", dtype="float32")
    assert ours.get_default_sampling_params() == SamplingParams()  # OpenAI's: temperature 1
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(model_dir), generation_config="/some/path")


def test_prompts_the_engine_cannot_take_are_refused_before_it_runs(checkpoint):
    """The engine trusts its front; the offline LLM is one, and checks what the engine cannot."""
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", max_model_len=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="maximum context length is 32 tokens.*40 input tokens"):
        llm.generate([[1] * 40], greedy)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy)
    with pytest.raises(ValueError, match=r"must be in \[0, 320\)"):
        llm.generate([[1, 999]], greedy)
    assert not llm.engine.has_unfinished_requests()
