"""One streamed reply of `nanoserve chat`: printed as it arrives, timed and counted."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanoserve.cli.openai_http_client import ClientError, OpenAIServer

# C0 and C1 control characters except newline and tab: a model's output must not be able to move
# the cursor, clear the screen or send escape sequences to the terminal.
_CONTROL_CHARS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if c not in (9, 10)}


@dataclass
class ReplyStats:
    """Timing and token counts of one streamed reply."""

    ttft_s: float | None = None  # from sending the request to the first text
    decode_s: float = 0.0  # from the first text to the last
    num_tokens: int = 0  # the server's usage count when it sent one, else the text chunks
    num_prompt_tokens: int | None = None
    finish_reason: str | None = None
    is_interrupted: bool = False

    def describe(self) -> str:
        parts = [f"ttft {self.ttft_s:.3f} s" if self.ttft_s is not None else "no text"]
        parts.append(f"{self.num_tokens} tokens")
        if self.num_tokens > 1 and self.decode_s > 0:
            # The tokens after the first over the time after the first: the decode speed.
            parts.append(f"{(self.num_tokens - 1) / self.decode_s:.1f} tokens/s")
        if self.num_prompt_tokens is not None:
            parts.append(f"prompt {self.num_prompt_tokens} tokens")
        if self.is_interrupted:
            parts.append("interrupted")
        elif self.finish_reason == "length":
            parts.append("stopped at the token limit")
        return " · ".join(parts)


def stream_reply(
    server: OpenAIServer,
    path: str,
    body: dict[str, Any],
    text_of: Callable[[dict[str, Any]], tuple[str, str]],
    dim: Callable[[str], str],
    on_accepted: Callable[[], None] = lambda: None,
) -> tuple[str, ReplyStats]:
    """Print a streamed reply as it comes (reasoning through `dim`); its text and stats.
    `on_accepted` runs once, at the first chunk (the server took the request). Ctrl-C ends
    the reply early."""
    stats = ReplyStats()
    pieces: list[str] = []
    num_chunks = 0
    start = first = last = time.perf_counter()
    chunks = server.stream(path, body)
    try:
        for index, chunk in enumerate(chunks):
            if index == 0:
                on_accepted()
            if chunk.get("usage"):
                stats.num_prompt_tokens = chunk["usage"].get("prompt_tokens")
                stats.num_tokens = chunk["usage"].get("completion_tokens") or 0
            for choice in chunk.get("choices") or []:
                stats.finish_reason = choice.get("finish_reason") or stats.finish_reason
            text, reasoning = text_of(chunk)
            if not (text or reasoning):
                continue
            last = time.perf_counter()
            if num_chunks == 0:
                first = last
                stats.ttft_s = first - start
            num_chunks += 1
            if reasoning:
                sys.stdout.write(dim(reasoning.translate(_CONTROL_CHARS)))
            if text:
                sys.stdout.write(text.translate(_CONTROL_CHARS))
                pieces.append(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stats.is_interrupted = True
        chunks.close()
        server.reset_connections()  # the server sees the connection close and aborts
    except ClientError:
        if pieces:
            print()
        raise
    if not stats.num_tokens:
        stats.num_tokens = num_chunks
    stats.decode_s = last - first
    print()
    return "".join(pieces), stats


def chat_text(chunk: dict[str, Any]) -> tuple[str, str]:
    """(content, reasoning) of a chat chunk's first choice."""
    choices = chunk.get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return delta.get("content") or "", reasoning


def completion_text(chunk: dict[str, Any]) -> tuple[str, str]:
    """(text, no reasoning) of a completion chunk's first choice."""
    choices = chunk.get("choices") or [{}]
    return choices[0].get("text") or "", ""
