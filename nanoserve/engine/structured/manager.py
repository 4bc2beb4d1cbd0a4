"""Builds grammar matchers off the step loop and fills the step's token bitmask in the background.

- `compile` returns a future: the tokenizer's token table (loaded once, on first use) and the
  request's matcher are built on a thread, so a large schema never stalls the running batch.
  The scheduler admits a constrained request only once its future is done.
- `start_masks` fills one bitmask row per constrained request of a step on another thread while
  the model's forward pass runs (llguidance releases the GIL); the runner waits for it only
  when it samples.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch

from nanoserve.engine.structured.grammar import GrammarState
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.structured_outputs import grammar_for

if TYPE_CHECKING:
    from nanoserve.engine.request import Request

logger = logging.getLogger("nanoserve.structured")


@dataclass
class GrammarMasks:
    """One step's masks: which batch rows are constrained, and their allowed tokens."""

    rows: list[int]  # [G]: rows of the step's sampling batch that have a grammar
    bitmask: torch.Tensor  # [G, ceil(V / 32)] int32: bit t % 32 of word t // 32 = token t allowed


class StructuredOutputManager:
    """The worker's grammar engine: one token table, matchers per request, masks per step."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._compile_pool: ThreadPoolExecutor | None = None
        self._mask_pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, constraint: StructuredOutputsParams) -> Future[GrammarState]:
        """Start building the matcher of `constraint`; the future fails with a ValueError."""
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        return self._compile_pool.submit(self._build, constraint)

    def _build(self, constraint: StructuredOutputsParams) -> GrammarState:
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_for(constraint), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output {constraint.kind}: {matcher.get_error()}")
        return GrammarState(matcher)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                from nanoserve.tokenizer import load_tokenizer

                hf_tokenizer: Any = load_tokenizer(self.tokenizer_dir)  # a fast tokenizer
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._ll_tokenizer

    def start_masks(self, requests: list[Request]) -> Future[GrammarMasks] | None:
        """Fill the masks of the constrained `requests` (the step's sampling rows) on a thread."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            self._executor = llguidance.LLExecutor()
        grammars = [requests[i].grammar for i in rows]
        return self._mask_pool.submit(self._fill_masks, rows, grammars)

    def _fill_masks(self, rows: list[int], grammars: list[GrammarState | None]) -> GrammarMasks:
        num_words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), num_words), -1, dtype=torch.int32)  # [G, W]
        matchers = [(g.matcher, k) for k, g in enumerate(grammars) if g is not None]
        assert self._executor is not None
        self._executor.unsafe_compute_mask_ptr(
            matchers, bitmask.data_ptr(), num_words * 4, len(rows)
        )
        return GrammarMasks(rows, bitmask)

    def shutdown(self) -> None:
        for pool in (self._compile_pool, self._mask_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def apply_grammar_masks(logits: torch.Tensor, masks: GrammarMasks) -> torch.Tensor:
    """Set every token the grammar forbids to -inf, in the constrained rows (in place)."""
    # logits: [B, V]; masks.bitmask: [G, W] with W * 32 >= V
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    bitmask = masks.bitmask.to(logits.device, non_blocking=True)
    allowed = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    allowed = allowed.flatten(1)[:, :vocab_size].bool()  # [G, V]
    rows = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)  # [G]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
