"""The official `openai` client against a real server: completions and chat, plain and streamed."""

from __future__ import annotations

import openai
import pytest
from cycle_model import CYCLE_TEXT
from servers import API_KEY, InProcessServer


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def cycle_client(cycle_server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cycle_server.url}/v1", api_key=API_KEY, max_retries=0)


def test_models_lists_every_served_name(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert all(m.model_extra["max_model_len"] == 1024 for m in models)


def test_completion_plain(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == "tiny"
    [choice] = response.choices
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 7)
    assert response.usage.total_tokens == 12


def test_completion_stream_equals_plain(cycle_client: openai.OpenAI) -> None:
    # The cycle model's greedy choice wins by a wide margin, so no batch shape or thread count
    # can round two runs apart (a random model's near ties can), and its text has 2-, 3- and
    # 4-byte characters split across tokens.
    kwargs = {"model": "cycle", "prompt": "H", "max_tokens": 10, "temperature": 0}
    plain = cycle_client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        cycle_client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text == CYCLE_TEXT[2:]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage == plain.usage


def test_chat_plain_and_stream(cycle_client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kwargs = {"model": "cycle", "messages": messages, "max_tokens": 8, "temperature": 0}
    plain = cycle_client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert plain.id.startswith("chatcmpl-") and plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 8
    chunks = list(
        cycle_client.chat.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage == plain.usage


def test_chat_max_tokens_defaults_to_rest_of_context(cycle_client: openai.OpenAI) -> None:
    response = cycle_client.chat.completions.create(
        model="cycle", messages=[{"role": "user", "content": "x"}], temperature=0
    )
    usage = response.usage
    assert response.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == 1024


def test_n_choices_with_seed_are_reproducible(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "prompt": "abc", "max_tokens": 6, "temperature": 1.0, "n": 3}
    kwargs["seed"] = 11
    first = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    second = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # seed + i: different samples
    assert first.usage.prompt_tokens == 3 and first.usage.completion_tokens == 18
    streamed = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in first.choices]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0 and token in top and 1 <= len(top) <= 4
        assert top[token] == max(top.values()) == pytest.approx(logprob)  # greedy: the best


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = response.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_stop_string(cycle_client: openai.OpenAI) -> None:
    response = cycle_client.completions.create(
        model="cycle", prompt="H", max_tokens=50, temperature=0, stop=["🎉", "zzz"]
    )
    [choice] = response.choices
    assert choice.text == "é世" and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "🎉"


def test_chat_with_the_cycle_model(cycle_client: openai.OpenAI) -> None:
    response = cycle_client.chat.completions.create(
        model="cycle",
        messages=[{"role": "user", "content": [{"type": "text", "text": "go"}]}],
        max_completion_tokens=len(CYCLE_TEXT.encode()),
        temperature=0,
    )
    assert response.choices[0].message.content == CYCLE_TEXT[1:] + "\n"
