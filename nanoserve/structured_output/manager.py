"""Builds grammar matchers off the step loop and fills the step's token bitmask in the background.

- `compile` returns a future: on one of MAX_CONCURRENT_COMPILES threads, a child process probes
  the constraint first (`sandbox.py`: a grammar that crashes llguidance, or compiles past the
  deadline, fails that request only), then the worker builds the matcher from the grammar the
  probe compiled. A large schema never stalls the running batch, a slow one holds one thread of
  the pool and never the others' constraints, and unconstrained requests never wait for any.
  The scheduler admits a constrained request only once its future is done. The tokenizer's
  token table is loaded once, on first use.
- `start_masks` fills one bitmask row per constrained request of a step on another thread while
  the model's forward pass runs (llguidance releases the GIL); the runner waits for it only
  when it samples.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import llguidance
import msgspec
import numpy as np
import torch

from nanoserve.common.sampling_params import StructuredOutputsParams
from nanoserve.core.grammar import Grammar, GrammarMasks
from nanoserve.structured_output.grammar import GrammarState
from nanoserve.structured_output.sandbox import COMPILE_TIMEOUT_S, GrammarSandbox

if TYPE_CHECKING:
    from nanoserve.core.request import Request

logger = logging.getLogger("nanoserve.structured")

COMPILED_CACHE_SIZE = 64  # constraints whose compiled matcher is kept for the next requests
# Constraints compiled at once (each probe holds a child process and a core while it runs).
MAX_CONCURRENT_COMPILES = 2


_NEG_INF_BITS = -8388608  # 0xFF800000 as an int32: the bits of float32 -inf


def bias_from_bitmask(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (bit t % 32 of int32 word t // 32 set = token t allowed) → [G, V].

    An additive bias rather than a boolean mask: on CPU, adding it is several times faster
    than `masked_fill`. It is built on the mask thread with operations that release the GIL
    (a numpy fancy index would hold it and stall the forward pass's Python): allowed bits
    become the float32 bits of 0.0, forbidden ones those of -inf.
    """
    # bitmask: [G, W] int32, little-endian words, so its bytes hold the bits in token order
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")  # [G, W * 32]
    bits = torch.from_numpy(allowed[:, :vocab_size]).to(torch.int32)  # [G, V]: 1 or 0
    return bits.sub_(1).bitwise_and_(_NEG_INF_BITS).view(torch.float32)  # [G, V]: 0.0 or -inf


class StructuredOutputManager:
    """The worker's grammar engine: one token table, matchers per request, masks per step."""

    def __init__(
        self,
        tokenizer_dir: Path,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        max_concurrent_compiles: int = MAX_CONCURRENT_COMPILES,
    ) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.max_concurrent_compiles = max_concurrent_compiles
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._sandbox: GrammarSandbox | None = None
        self._tokenizer_lock = threading.Lock()
        self._is_shut_down = False
        self._compile_pool: ThreadPoolExecutor | None = None
        # Compiled matchers of recent constraints, by a hash of the constraint; LRU order.
        self._compiled: OrderedDict[bytes, Future[llguidance.LLMatcher]] = OrderedDict()
        self._compiled_lock = threading.Lock()
        self._mask_pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, constraint: StructuredOutputsParams) -> Future[Grammar]:
        """Start building the matcher of `constraint`; the future fails with a ValueError.

        A constraint seen recently (the n choices of one request, a client's repeated schema)
        is compiled once: each request gets a copy of the compiled matcher.
        """
        key = hashlib.sha256(msgspec.json.encode(constraint)).digest()
        with self._compiled_lock:
            compiled = self._compiled.pop(key, None)
            if compiled is None:
                if self._compile_pool is None:
                    self._compile_pool = ThreadPoolExecutor(
                        self.max_concurrent_compiles, thread_name_prefix="grammar-compile"
                    )
                compiled = self._compile_pool.submit(self._build, constraint)
            self._compiled[key] = compiled  # the most recently used last
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        grammar: Future[Grammar] = Future()
        compiled.add_done_callback(lambda done: _copy_into(done, grammar))
        return grammar

    def _build(self, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The probe first (it says why a constraint does not compile), then the matcher."""
        try:
            tokenizer, sandbox = self._token_table()
            matcher = llguidance.LLMatcher(tokenizer, sandbox.probe(constraint), log_level=0)
        except ValueError:
            raise
        except Exception as e:  # not the constraint's fault; it still fails this request only
            logger.exception("compiling a structured output %s failed", constraint.kind)
            raise ValueError(f"structured output {constraint.kind} did not compile: {e!r}") from e
        if matcher.is_error():  # the probe built the same matcher: not expected
            raise ValueError(f"invalid structured output {constraint.kind}: {matcher.get_error()}")
        return matcher

    def _token_table(self) -> tuple[llguidance.LLTokenizer, GrammarSandbox]:
        """The token table (built once, from the checkpoint's fast tokenizer, as llguidance.hf
        builds it) and the sandbox, whose children load the same table."""
        with self._tokenizer_lock:
            if self._is_shut_down:
                raise ValueError("structured output is shutting down")
            if self._ll_tokenizer is None or self._sandbox is None:
                from nanoserve.text.tokenizer import load_tokenizer

                hf_tokenizer: Any = load_tokenizer(self.tokenizer_dir)  # a fast tokenizer
                backend = copy.copy(hf_tokenizer.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                tokenizer_json = backend.to_str()
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
                self._sandbox = GrammarSandbox(
                    tokenizer_json, self.vocab_size, self.eos_token_ids, self.compile_timeout_s
                )
            return self._ll_tokenizer, self._sandbox

    def start_masks(
        self, requests: list[Request], draft_token_ids: list[list[int]]
    ) -> Future[GrammarMasks] | None:
        """Fill the masks of the constrained `requests` (the step's sampling requests) on a
        thread: a row at each one's state, then a row after each of its drafts."""
        constrained: list[tuple[int, GrammarState, list[int]]] = []
        first_row = 0
        for request, drafts in zip(requests, draft_token_ids, strict=True):
            if request.grammar is not None:
                constrained.append((first_row, cast(GrammarState, request.grammar), drafts))
            first_row += 1 + len(drafts)
        if not constrained:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            self._executor = llguidance.LLExecutor()
        return self._mask_pool.submit(self._fill_masks, constrained)

    def _fill_masks(self, constrained: list[tuple[int, GrammarState, list[int]]]) -> GrammarMasks:
        """The bitmask of every constrained row, as a [G, V] bias (all off the step loop).

        Draft rows: each matcher consumes its drafts one at a time (the speculator drafted only
        tokens it accepts), a mask after each, and is rolled back to where it was.
        """
        num_words = (self.vocab_size + 31) // 32
        rows = [first + j for first, _, drafts in constrained for j in range(len(drafts) + 1)]
        bitmask = np.full((len(rows), num_words), -1, dtype=np.int32)  # [G, W]
        assert self._executor is not None
        mask_row = {row: k for k, row in enumerate(rows)}
        for position in range(1 + max(len(drafts) for _, _, drafts in constrained)):
            matchers = []
            for first, state, drafts in constrained:
                if position > len(drafts):
                    continue
                if position and not state.accept(drafts[position - 1]):
                    raise ValueError("a draft the grammar refuses reached the masks")
                matchers.append((state.matcher, mask_row[first + position]))
            self._executor.unsafe_compute_mask_ptr(
                matchers, bitmask.ctypes.data, num_words * 4, len(rows)
            )
        for _, state, drafts in constrained:
            if drafts:
                state.rollback(len(drafts))
        return GrammarMasks(rows, bias_from_bitmask(bitmask, self.vocab_size))

    def shutdown(self) -> None:
        """Stop both pools and kill the probe processes (a compile in flight fails)."""
        for pool in (self._compile_pool, self._mask_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        with self._tokenizer_lock:  # a token table being loaded is loaded first
            self._is_shut_down = True
            if self._sandbox is not None:
                self._sandbox.close()


def _copy_into(compiled: Future[llguidance.LLMatcher], grammar: Future[Grammar]) -> None:
    """Resolve one request's grammar from a compiled matcher: its own copy, or the error."""
    if grammar.cancelled():
        return
    error = compiled.exception()
    if error is not None:
        grammar.set_exception(error)
    else:
        grammar.set_result(GrammarState(compiled.result().deep_copy()))
