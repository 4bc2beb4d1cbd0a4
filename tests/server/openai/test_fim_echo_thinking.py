"""Success paths: fill-in-the-middle with FIM tokens, echo, and thinking switched off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import InProcessServer

from nanoserve.text.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parents[3] / "nanoserve" / "assets" / "demo"
# ChatML that, like Qwen3's, opens an empty think block when thinking is off.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    log = tmp_path_factory.mktemp("demo") / "server.log"
    server = InProcessServer(DEMO, log, "--chat-template", THINKING_TEMPLATE)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def complete(server: InProcessServer, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json={"max_tokens": 4, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_suffix_frames_the_prompt_with_fim_tokens(demo_server: InProcessServer) -> None:
    tokenizer = load_tokenizer(DEMO)
    fim = "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>"
    expected = len(tokenizer.encode(fim, add_special_tokens=False))
    body = {"prompt": "def f(x):\n    ", "suffix": "\n    return y", "temperature": 0}
    result = complete(demo_server, "/v1/completions", body)
    assert result["usage"]["prompt_tokens"] == expected
    assert isinstance(result["choices"][0]["text"], str)


def test_echo_puts_the_prompt_before_the_completion(demo_server: InProcessServer) -> None:
    body = {"prompt": "import os\n", "temperature": 0}
    plain = complete(demo_server, "/v1/completions", body)["choices"][0]["text"]
    echoed = complete(demo_server, "/v1/completions", {**body, "echo": True})["choices"][0]
    assert echoed["text"] == "import os\n" + plain


def test_reasoning_effort_none_turns_thinking_off(demo_server: InProcessServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    base = complete(demo_server, "/v1/chat/completions", {"messages": messages})
    off = complete(
        demo_server, "/v1/chat/completions", {"messages": messages, "reasoning_effort": "none"}
    )
    kwargs = complete(
        demo_server,
        "/v1/chat/completions",
        {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
    )
    think_block = len(
        load_tokenizer(DEMO).encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    )
    assert off["usage"]["prompt_tokens"] == base["usage"]["prompt_tokens"] + think_block
    assert kwargs["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]
