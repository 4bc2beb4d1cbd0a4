"""What a request may pass to the chat template: variables only; its own template only when the
operator trusts request templates, and then as text; rendering errors are 400s."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.server.errors import APIError
from nanoserve.server.openai.api_models import ChatMessage
from nanoserve.server.openai.chat_prompt import (
    RESERVED_TEMPLATE_ARGS,
    check_template_kwargs,
    num_message_chars,
    render_chat_prompt,
    request_chat_template,
)
from nanoserve.server.tokenizer_pool import TokenizerPool
from nanoserve.text.tokenizer import load_tokenizer

USER = [ChatMessage(role="user", content="hi")]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")
    pool = TokenizerPool(load_tokenizer(model))
    yield pool
    pool.shutdown()


def render(pool: TokenizerPool, template: str | None = None, max_chars: int = 10_000, **kwargs):
    return asyncio.run(render_chat_prompt(pool, USER, True, template, kwargs, max_chars))


@pytest.mark.parametrize(
    "name",
    [
        "chat_template", "tokenize", "tools", "documents", "conversation", "messages",
        "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer_kwargs",
        "padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
    ],
)  # fmt: skip
def test_call_arguments_are_refused(name: str) -> None:
    assert name in RESERVED_TEMPLATE_ARGS
    with pytest.raises(APIError, match=name) as info:
        check_template_kwargs({"enable_thinking": False, name: "x"})
    assert info.value.status_code == 400 and info.value.param == "chat_template_kwargs"


def test_template_variables_pass() -> None:
    kwargs = {"enable_thinking": False, "custom_instructions": "be brief", "bos_token": "<s>"}
    assert check_template_kwargs(kwargs) == kwargs
    assert check_template_kwargs(None) == {}


def test_a_request_template_needs_trust() -> None:
    with pytest.raises(APIError, match="--trust-request-chat-template") as info:
        request_chat_template("{{ messages }}", is_trusted=False)
    assert info.value.param == "chat_template"
    assert request_chat_template(None, is_trusted=False) is None
    assert request_chat_template("/etc/passwd", is_trusted=True) == "/etc/passwd"


def test_a_trusted_template_that_names_a_file_renders_the_name(
    pool: TokenizerPool, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.jinja"
    secret.write_text("SECRET {{ messages }}")
    ids = render(pool, str(secret))
    assert pool.decode_now(ids) == str(secret)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
        ("{% for %}", "could not apply the chat template"),
        ("{{ messages[5]['content'] }}", "could not apply the chat template"),
        ("{{ 1 / 0 }}", "could not apply the chat template"),
        ("{{ raise_exception('no') }}", "could not apply the chat template"),
        ("{{ ''.__class__.__mro__ }}", "could not apply the chat template"),  # the sandbox
    ],
)
def test_template_errors_are_400(pool: TokenizerPool, template: str, message: str) -> None:
    with pytest.raises(APIError, match=message) as info:
        render(pool, template)
    assert info.value.status_code == 400 and info.value.param == "messages"


def test_deeply_nested_content_is_400(pool: TokenizerPool) -> None:
    nested: list = []
    # Deeper than the recursion limit, whatever it is now: inductor raises it to 2,000 when
    # a test earlier in the same run compiles.
    for _ in range(sys.getrecursionlimit() + 100):
        nested = [nested]
    message = ChatMessage.model_validate({"role": "user", "content": "x", "extra": nested})
    with pytest.raises(APIError, match="recursed too deeply"):
        asyncio.run(render_chat_prompt(pool, [message], True, None, {}, 10_000))


def test_the_rendered_prompt_is_measured_before_tokenizing(pool: TokenizerPool) -> None:
    long_template = "{{ 'x' * 5000 }}{{ messages[0]['content'] }}"
    with pytest.raises(APIError, match="5002 characters") as info:
        render(pool, long_template, max_chars=5000)
    assert "--max-prompt-chars" in info.value.message
    assert len(render(pool, long_template, max_chars=5002)) == 5002


def test_every_string_a_message_hands_the_template_is_counted() -> None:
    parts = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text"}]}
    )
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}  # keys count too
    tool_call = ChatMessage.model_validate({"role": "assistant", "tool_calls": [call]})
    assert num_message_chars([*USER, parts]) == len("userhiuserabc")
    assert num_message_chars([tool_call]) == len("assistanttool_callsidc1") + len(
        "functionnamefarguments{}"
    )
