"""Chat messages to prompt token ids: what a request may pass to the chat template.

Templates come from the checkpoint or from `--chat-template`, never from a file a request
names. A request adds template *variables* only (`chat_template_kwargs`, e.g.
`{"enable_thinking": false}`); the arguments of the template call itself — which template,
whether to tokenize, tools, documents, padding, ... — are refused there, as vLLM refuses
`chat_template` and `tokenize`. A request's own `chat_template` is refused unless the operator
started the server with `--trust-request-chat-template`; then it is template text, never a path.
Rendering runs on the tokenizer thread, and any error it raises on a client's input (a bad
template, a recursive macro, content nested too deep) is a 400. Rendering is never the first
check: the messages are counted as the body is read (`api_models.MAX_MESSAGES`), every string
they and the template variables hand the template is measured before rendering, the rendered
text before tokenizing, and the token ids are checked as every prompt is
(`checks.check_prompt`).
"""

from __future__ import annotations

import inspect
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from nanoserve.server.errors import APIError
from nanoserve.server.openai.api_models import ChatCompletionRequest, ChatMessage
from nanoserve.server.openai.chat_tools import templated_tool_calls
from nanoserve.server.openai.checks import check_prompt, check_prompt_chars
from nanoserve.server.openai.served_model import ServedModel
from nanoserve.server.tokenizer_pool import TokenizerPool
from nanoserve.text.tokenizer import render_chat_template

# The parameters of transformers' apply_chat_template (whichever version is installed) and the
# names its renderer gives the template itself: none of them is a template variable.
RESERVED_TEMPLATE_ARGS = frozenset(
    set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    - {"self", "kwargs"}
    | {"conversation", "messages", "tools", "documents", "chat_template", "tokenize"}
)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# What rendering a client's messages with a template can raise.
RENDER_ERRORS = (
    *(jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError),
    *(ZeroDivisionError, OverflowError, RecursionError),
)


async def chat_prompt(
    model: ServedModel, request: ChatCompletionRequest, template_tools: list[dict[str, Any]] | None
) -> list[int]:
    """A chat request's prompt token ids: its messages (and the tools the template shows)."""
    kwargs = template_kwargs(request)
    if template_tools is not None:
        kwargs["tools"] = template_tools  # set by the server, never by the request
    return await render_messages(
        model, request.messages, request.add_generation_prompt, request.chat_template, kwargs
    )


async def render_messages(
    model: ServedModel,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    chat_template: str | None,
    kwargs: dict[str, Any],
) -> list[int]:
    """Messages rendered with the chat template, as checked prompt token ids."""
    template = request_chat_template(chat_template, model.config.trust_request_chat_template)
    check_prompt_chars(model, num_message_chars(messages), "messages")
    check_prompt_chars(
        model, num_chars(kwargs), "tools" if "tools" in kwargs else "chat_template_kwargs"
    )
    prompt = await render_chat_prompt(
        model.pool, messages, add_generation_prompt, template, kwargs, model.max_prompt_chars
    )
    check_prompt(model, prompt, "messages")
    return prompt


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    """Extra template variables: chat_template_kwargs, and reasoning_effort mapped onto them."""
    kwargs = check_template_kwargs(request.chat_template_kwargs)
    effort = request.reasoning_effort
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise APIError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                400,
                "reasoning_effort",
            )
        if effort == "none":
            kwargs.setdefault("enable_thinking", False)
        else:
            kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: plain dicts, content never missing."""
    rendered = []
    for message in messages:
        item = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            item["content"] = [p.model_dump(exclude_none=True) for p in message.content]
        item.setdefault("content", "")
        if "tool_calls" in item:
            item["tool_calls"] = templated_tool_calls(item["tool_calls"])
        rendered.append(item)
    return rendered


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs`, if every key is a plain template variable (else a 400)."""
    kwargs = dict(kwargs or {})
    refused = sorted(RESERVED_TEMPLATE_ARGS.intersection(kwargs))
    if refused:
        raise APIError(
            f"chat_template_kwargs may only set template variables; {', '.join(refused)} "
            f"{'is an argument' if len(refused) == 1 else 'are arguments'} of the template call "
            "itself and cannot be set by a request (a template of your own goes in the "
            "top-level chat_template field, if the server allows it)",
            400,
            "chat_template_kwargs",
        )
    return kwargs


def request_chat_template(chat_template: str | None, is_trusted: bool) -> str | None:
    """The template text a request brings, if the server trusts request templates."""
    if chat_template is None:
        return None
    if not is_trusted:
        raise APIError(
            "chat_template in a request is refused: this server renders its own chat template "
            "(start it with --trust-request-chat-template to allow template text in requests)",
            400,
            "chat_template",
        )
    return chat_template  # text; transformers compiles it, nothing reads it as a path


def num_message_chars(messages: list[ChatMessage]) -> int:
    """Characters of every string the messages hand the template (roles, content, names, tool
    calls, other keys): what the rendered prompt is built from."""
    total = 0
    for message in messages:
        total += len(message.role)
        if isinstance(message.content, str):
            total += len(message.content)
        elif message.content is not None:
            total += sum(len(part.text or "") for part in message.content)
        total += num_chars(message.model_extra)
    return total


def num_chars(value: Any) -> int:
    """Characters of the strings (keys too) in a JSON-like value, walked without recursion."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return total


class PromptTooLongError(ValueError):
    """The rendered prompt has more characters than the server takes."""


async def render_chat_prompt(
    pool: TokenizerPool,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    chat_template: str | None,
    template_kwargs: dict[str, Any],
    max_chars: int,
) -> list[int]:
    """The prompt's token ids, rendered and encoded on the tokenizer thread (400 on errors).

    The rendered text is measured before it is tokenized: a template can make a short
    conversation long.
    """
    args = (messages, add_generation_prompt, chat_template, template_kwargs, max_chars)
    try:
        return await pool.run(_render_and_encode, pool.tokenizer, *args)
    except PromptTooLongError as e:
        raise APIError(str(e), 400, "messages") from None
    except RecursionError:
        raise APIError(
            "could not apply the chat template: it recursed too deeply (a recursive macro, or "
            "message content nested too deep)",
            400,
            "messages",
        ) from None
    except RENDER_ERRORS as e:
        raise APIError(f"could not apply the chat template: {e}", 400, "messages") from None


def _render_and_encode(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    chat_template: str | None,
    template_kwargs: dict[str, Any],
    max_chars: int,
) -> list[int]:
    text = render_chat_template(
        tokenizer,
        template_messages(messages),
        add_generation_prompt,
        chat_template,
        **template_kwargs,
    )
    if len(text) > max_chars:
        raise PromptTooLongError(
            f"the chat template rendered the messages to {len(text)} characters; this server "
            f"takes at most {max_chars} characters per prompt (--max-prompt-chars)"
        )
    return list(tokenizer.encode(text, add_special_tokens=False))
