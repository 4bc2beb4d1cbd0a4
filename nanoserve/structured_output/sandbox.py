"""GrammarSandbox: each new constraint compiled first in a child process, where a crash or a
hang costs one request, never the worker.

llguidance is native code. Some grammars overflow its stack and kill the process compiling
them (a chain of a thousand `$ref`s, three thousand chained Lark rules), and a large one may
compile for seconds. So the worker builds a constraint's matcher only after a probe child has
done the same and survived:

- the child turns the constraint into an llguidance grammar (`grammar_for`), builds its matcher
  on a thread (the stack size the worker's compile threads have) and walks its first tokens:
  llguidance refuses some grammars only there, once a parser row grows too wide ("Current row
  has 2001 items; max is 2000") or a lexeme exhausts the lexer's fuel (`a{1000000}`). It
  answers the grammar text, which the worker builds its matcher from, or llguidance's error;
- a child that dies answers nothing: that request fails ("the grammar compiler crashed") and
  the next probe starts a new child; one that has not answered within `timeout_s` is killed and
  its request fails with the deadline.

Children are reused from probe to probe (each loads the token table once: about a second for a
150,000-token vocabulary), one per probe running at a time; they die with the thread that
started them (PR_SET_PDEATHSIG) and are killed by `close()`.

Run as `python -m nanoserve.structured_output.sandbox`, this module is the child: frames of
msgpack (a 4-byte length, then the message) on stdin and on the descriptor stdout was.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TypeVar

import llguidance
import msgspec
import numpy as np

from nanoserve.common.sampling_params import StructuredOutputsParams
from nanoserve.structured_output.grammars import grammar_for

COMPILE_TIMEOUT_S = 10.0  # a probe's deadline: the largest grammars the front allows take ~2 s
START_TIMEOUT_S = 120.0  # a new child's imports and token table
NUM_FIRST_TOKENS = 4  # the first allowed tokens the walk takes, each on a copy of the matcher
NUM_WALK_TOKENS = 8  # and after each, this many more (the lowest allowed token each time)
_HEADER = struct.Struct("<I")
T = TypeVar("T")

logger = logging.getLogger("nanoserve.structured")


class SandboxSetup(msgspec.Struct, array_like=True):
    """A new child's first message: the token table it compiles against."""

    tokenizer_json: str  # the fast tokenizer's own JSON, as llguidance.hf reads it
    vocab_size: int
    eos_token_ids: list[int]


class ProbeResult(msgspec.Struct, array_like=True):
    """A child's answer: the llguidance grammar that compiled, or why it did not."""

    grammar: str = ""
    error: str = ""


class GrammarSandbox:
    """Probes each constraint in a child process before the worker compiles it."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self.timeout_s = timeout_s
        self._setup = msgspec.msgpack.encode(
            SandboxSetup(tokenizer_json, vocab_size, eos_token_ids)
        )
        self._idle: list[_Child] = []
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self._is_closed = False

    def probe(self, constraint: StructuredOutputsParams) -> str:
        """The llguidance grammar of `constraint`, once a child has compiled it and survived;
        a ValueError saying why not (llguidance's error, a crash, the deadline)."""
        child = self._take()
        try:
            answer = child.ask(msgspec.msgpack.encode(constraint), self.timeout_s)
        except TimeoutError:
            self._discard(child)
            logger.warning(
                "a structured output %s took over %g s to compile: refused",
                constraint.kind,
                self.timeout_s,
            )
            raise ValueError(
                f"structured output {constraint.kind}: compiling it took longer than "
                f"{self.timeout_s:g} s; give a smaller or simpler {constraint.kind}"
            ) from None
        except EOFError:
            how = self._discard(child)
            logger.warning(
                "a structured output %s crashed the grammar compiler (%s): refused",
                constraint.kind,
                how,
            )
            raise ValueError(
                f"structured output {constraint.kind}: the grammar compiler crashed on it "
                f"({how}); give a smaller or simpler {constraint.kind}"
            ) from None
        with self._lock:
            self._idle.append(child)
        result = msgspec.msgpack.decode(answer, type=ProbeResult)
        if result.error:
            raise ValueError(result.error)
        return result.grammar

    def _take(self) -> _Child:
        """An idle child, or a new one (started under the lock: `close` misses none)."""
        with self._lock:
            if self._is_closed:
                raise ValueError("structured output is shutting down")
            if self._idle:
                return self._idle.pop()
            child = _Child(self._setup)
            self._children.add(child)
            return child

    def _discard(self, child: _Child) -> str:
        """Kill and reap `child`; how it ended."""
        with self._lock:
            self._children.discard(child)
        return child.kill()

    def close(self) -> None:
        """Kill every child; probes in flight fail."""
        with self._lock:
            self._is_closed = True
            children, self._children, self._idle = list(self._children), set(), []
        for child in children:
            child.kill()


class _Child:
    """One probe process, its pipes, and a deadline on every answer."""

    def __init__(self, setup: bytes) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nanoserve.structured_output.sandbox"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin, self._stdout = self.process.stdin, self.process.stdout
        self._is_started = False
        self._setup = setup

    def ask(self, message: bytes, timeout_s: float) -> bytes:
        """Send one message and read the answer; TimeoutError past `timeout_s`, EOFError if the
        child died (a new child first gets its setup, under a deadline of its own)."""
        try:
            if not self._is_started:
                _write_frame(self._stdin, self._setup)
                self._is_started = True
                _write_frame(self._stdin, message)
                return self._read_frame(time.monotonic() + START_TIMEOUT_S + timeout_s)
            _write_frame(self._stdin, message)
        except (BrokenPipeError, ConnectionResetError):
            raise EOFError from None
        return self._read_frame(time.monotonic() + timeout_s)

    def _read_frame(self, deadline: float) -> bytes:
        header = self._read_exactly(_HEADER.size, deadline)
        return self._read_exactly(_HEADER.unpack(header)[0], deadline)

    def _read_exactly(self, num_bytes: int, deadline: float) -> bytes:
        data = bytearray()
        fd = self._stdout.fileno()
        while len(data) < num_bytes:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0 or not select.select([fd], [], [], remaining_s)[0]:
                raise TimeoutError
            chunk = os.read(fd, num_bytes - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)

    def kill(self) -> str:
        """Kill and reap the process, close its pipes; how it ended."""
        self.process.kill()
        code = self.process.wait()
        for pipe in (self._stdin, self._stdout):
            pipe.close()
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


def _write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


# ---- the child ----


def probe(tokenizer: llguidance.LLTokenizer, constraint: StructuredOutputsParams) -> ProbeResult:
    """Compile `constraint` as the worker will, then walk its first tokens."""
    try:
        grammar = grammar_for(constraint)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        error = _first_tokens_error(matcher, tokenizer.vocab_size)
    except ValueError as e:
        return ProbeResult(error=str(e))
    except Exception as e:  # e.g. a RecursionError converting a deeply nested GBNF grammar
        return ProbeResult(error=f"invalid structured output {constraint.kind}: {e!r}")
    if error is not None:
        reason = error.split("\n<state>", 1)[0].strip()  # without the parser state dump
        return ProbeResult(error=f"invalid structured output {constraint.kind}: {reason}")
    return ProbeResult(grammar=grammar)


def _first_tokens_error(matcher: llguidance.LLMatcher, vocab_size: int) -> str | None:
    """llguidance's error if it refuses the grammar on the paths of its first tokens: each of
    the first NUM_FIRST_TOKENS allowed tokens, then the lowest allowed one NUM_WALK_TOKENS
    times (on a copy of the matcher each)."""
    if matcher.is_error():
        return matcher.get_error()
    for first_id in _allowed_token_ids(matcher, vocab_size)[:NUM_FIRST_TOKENS]:
        walker, token_id = matcher.deep_copy(), first_id
        for _ in range(1 + NUM_WALK_TOKENS):
            if not walker.consume_token(token_id):
                return walker.get_error()
            allowed = _allowed_token_ids(walker, vocab_size)
            if walker.is_error():
                return walker.get_error()
            if walker.is_stopped() or not allowed:
                break
            token_id = allowed[0]
    return None


def _allowed_token_ids(matcher: llguidance.LLMatcher, vocab_size: int) -> list[int]:
    """The tokens the matcher allows next, in id order (EOS among them when it may end)."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    allowed = np.unpackbits(bits, bitorder="little")[:vocab_size]  # [V]: 1 where allowed
    return allowed.nonzero()[0].tolist()


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the thread that started it ends."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _read_message(stream: IO[bytes], kind: type[T]) -> T | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the worker closed the pipe: it is gone or done with us
    return msgspec.msgpack.decode(stream.read(_HEADER.unpack(header)[0]), type=kind)


def main() -> None:
    """The child: read the setup, then answer each constraint with its ProbeResult."""
    _die_with_parent()
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the frames
    requests = sys.stdin.buffer
    setup = _read_message(requests, SandboxSetup)
    if setup is None:
        return
    tokenizer = llguidance.LLTokenizer(
        setup.tokenizer_json, n_vocab=setup.vocab_size, eos_token=setup.eos_token_ids
    )
    with ThreadPoolExecutor(1, thread_name_prefix="grammar-probe") as compile_thread:
        while (constraint := _read_message(requests, StructuredOutputsParams)) is not None:
            result = compile_thread.submit(probe, tokenizer, constraint).result()
            _write_frame(answers, msgspec.msgpack.encode(result))


if __name__ == "__main__":
    main()
