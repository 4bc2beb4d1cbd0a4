"""ServedModel: the model one server serves, as its routes see it.

`create_app` builds one and hands it to every API module's router; a route reads the server's
settings, the engine client, the tokenizer thread and the metrics from it, and the model's
limits (context length, vocabulary) once the engine has reported them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from nanoserve.client.engine_client import EngineClient
from nanoserve.common.protocol import Ready
from nanoserve.server.config import ServerConfig
from nanoserve.server.errors import service_unavailable
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.tokenizer_pool import TokenizerPool
from nanoserve.text.output_processor import TOKEN_TEXT_CACHE_SIZE


class ServedModel:
    """The model behind the routes: settings, engine client, tokenizer thread, metrics, limits."""

    def __init__(
        self,
        config: ServerConfig,
        client: EngineClient,
        pool: TokenizerPool,
        metrics: ServerMetrics,
    ) -> None:
        self.config = config
        self.client = client
        self.pool = pool
        self.tokenizer = pool.tokenizer
        self.metrics = metrics
        self.name = config.served_model_names[0]  # the name answers carry
        # No token is longer than this (vocab strings are at least as long as their text).
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        # One token's text, decoded here (logprobs name many tokens, most of them often).
        self.token_text: Callable[[int], str] = lru_cache(maxsize=TOKEN_TEXT_CACHE_SIZE)(
            lambda token_id: pool.decode_now([token_id])
        )

    @property
    def engine_info(self) -> Ready:
        """What the worker said when it became ready (503 until the first worker has)."""
        if self.client.info is None:
            raise service_unavailable("the model worker has not started yet; retry shortly")
        return self.client.info

    @property
    def max_model_len(self) -> int:
        return self.engine_info.max_model_len

    @property
    def num_token_ids(self) -> int:
        """Token ids a request may use: known to the tokenizer and inside the model's vocab."""
        return min(self.engine_info.vocab_size, len(self.tokenizer))

    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt text taken: --max-prompt-chars, or what could fit in max_model_len."""
        if self.config.max_prompt_chars is not None:
            return self.config.max_prompt_chars
        return self.max_model_len * self.max_token_chars
