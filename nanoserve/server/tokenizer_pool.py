"""Tokenizer work off the event loop: encoding, chat templates and decoding on one thread.

Tokenizing a long prompt or rendering a long conversation takes from milliseconds to seconds;
on the event loop it would stall every other stream's tokens and even `/health`. Here it runs on
a single worker thread, one job at a time, in arrival order (as vLLM's front does): the Rust
tokenizer releases the GIL while it encodes, so the loop keeps serving. One thread, not more:
the fast tokenizer is not safe to reconfigure while another thread uses it, and a queue of jobs
on one thread is bounded work per job because the callers cap a prompt's size first.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

R = TypeVar("R")


class TokenizerPool:
    """Runs the front's tokenizer calls on one thread beside the event loop."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-tokenizer")

    async def run(self, function: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """`function(*args, **kwargs)` on the tokenizer thread; its exception is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, functools.partial(function, *args, **kwargs)
        )

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run(self.decode_now, token_ids)

    def decode_now(self, token_ids: list[int]) -> str:
        """Decode here, on the caller's thread (for a token or a few)."""
        text = self.tokenizer.decode(token_ids)
        assert isinstance(text, str)  # one sequence decodes to one string
        return text

    def shutdown(self) -> None:
        """Stop taking jobs; a job already running finishes on its own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
