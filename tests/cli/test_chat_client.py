"""The terminal chat client (its own process), driven through a pseudo-terminal against the real
server app and engine (in this process)."""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from servers import InProcessServer, free_port
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.cli.chat import DEFAULT_REPLY_LIMIT, ChatSession, add_arguments
from nanoserve.cli.help_format import DefaultsHelpFormatter
from nanoserve.cli.openai_http_client import ClientError, OpenAIServer

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 180
REPLY_TIMEOUT_S = 60
# After Ctrl-C the server must stop before this share of the reply's remaining tokens could
# have been generated: finishing them instead is the bug, whatever the machine's speed.
ABORT_SHARE_OF_THE_REST = 0.25
API_KEY = "chat-test-key"
# The byte tokenizer's ChatML prompt for one user message "hello", generation prompt included:
# <|im_start|> "user\n" "hello" <|im_end|> "\n" <|im_start|> "assistant\n"
HELLO_PROMPT_TOKENS = 1 + 5 + 5 + 1 + 1 + 1 + 10
STATS = re.compile(
    r"(?:ttft (\d+\.\d+) s|no text) · (\d+) tokens(?: · [\d.]+ tokens/s)?"
    r"(?: · prompt (\d+) tokens)?(.*)(?=\n)"
)
PROMPT = "\n> "
SELECT_WAITS = ("poll_schedule_timeout", "do_select")  # where the kernel parks select()
ANSI_ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|[=>])")


def num_requests_running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert match, text
    return float(match.group(1))


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server on a tiny random Qwen3 with room for long replies."""
    tmp = tmp_path_factory.mktemp("chat_server")
    model = make_tiny_checkpoint(tmp / "model", "qwen3", max_position_embeddings=4096)
    with InProcessServer(model, tmp / "server.log", "--api-key", API_KEY) as server:
        yield server.url


class Terminal:
    """The chat client in a pseudo-terminal: type keys, wait for text on the screen."""

    def __init__(self, *args: str, history_file: Path) -> None:
        # The key comes from the environment, as it would for a user.
        env = {**os.environ, "TERM": "xterm", "NANOSERVE_API_KEY": API_KEY, "OPENAI_API_KEY": ""}
        env.pop("NO_COLOR", None)
        argv = [
            sys.executable, "-m", "nanoserve.cli.chat", "--history-file", str(history_file),
            "--temperature", "0", *args,
        ]  # fmt: skip
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, so ^C is SIGINT
            try:
                os.execve(sys.executable, argv, env)
            finally:
                os._exit(127)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.raw = b""
        self.position = 0  # in `screen`: where the next expect() starts looking
        self.exit_status: int | None = None

    @property
    def screen(self) -> str:
        """Everything the client wrote, without colours, cursor codes and carriage returns."""
        text = self.raw.decode(errors="replace").replace("\r", "")
        return ANSI_ESCAPE.sub("", text)

    def read(self, timeout_s: float) -> bool:
        """Read what is there (waiting up to timeout_s); False once the client has exited."""
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        self.raw += data
        return bool(data)

    def expect(self, pattern: str | re.Pattern, timeout_s: float = REPLY_TIMEOUT_S) -> re.Match:
        regex = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout_s
        while True:
            match = regex.search(self.screen, self.position)
            if match:
                self.position = match.end()
                return match
            if time.monotonic() > deadline or not self.read(0.1):
                raise AssertionError(
                    f"{regex.pattern!r} not on the screen; after the last match:\n"
                    f"{self.screen[self.position :]!r}"
                )

    def wait_for_key_wait(self, timeout_s: float = 10) -> None:
        """Until the client's main thread sleeps in select() on the terminal (readline's wait
        for a key), as the kernel reports it."""
        deadline = time.monotonic() + timeout_s
        while not any(f in Path(f"/proc/{self.pid}/wchan").read_text() for f in SELECT_WAITS):
            assert time.monotonic() < deadline, "the client never waited for a key"
            self.read(0.01)  # paces the poll, and keeps the terminal drained

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def line(self, text: str) -> None:
        self.type(text + "\r")

    def stats_after(self, text: str) -> re.Match:
        """Send a line, wait for its reply's stats line and the next prompt."""
        self.line(text)
        stats = self.expect(STATS)
        self.expect(PROMPT)
        return stats

    def wait_exit(self, timeout_s: float = 10) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.read(0.05)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exit_status = os.waitstatus_to_exitcode(status)
                return self.exit_status
        raise AssertionError(f"the client did not exit; screen:\n{self.screen[-2000:]!r}")

    def close(self) -> None:
        if self.exit_status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[..., Terminal]]:
    started: list[Terminal] = []

    def start(*args: str) -> Terminal:
        term = Terminal(*args, history_file=tmp_path / "history")
        started.append(term)
        return term

    yield start
    for term in started:
        term.close()


def test_a_message_streams_a_reply_with_stats(server_url: str, terminal, tmp_path: Path) -> None:
    term = terminal("--url", server_url, "--extra-body", '{"ignore_eos": true}')
    term.expect("model: ")
    term.expect(PROMPT)
    term.line("/max 12")
    term.expect("max tokens per reply: 12")
    stats = term.stats_after("hello")
    assert int(stats.group(2)) == 12  # the usage chunk's count: ignore_eos runs to /max
    assert int(stats.group(3)) == HELLO_PROMPT_TOKENS  # one user message, no system prompt
    assert "stopped at the token limit" in stats.group(4)
    assert float(stats.group(1)) > 0
    term.type("\x04")  # Ctrl-D at the prompt quits
    assert term.wait_exit() == 0
    assert "Traceback" not in term.screen
    assert (tmp_path / "history").read_text().splitlines()[-2:] == ["/max 12", "hello"]


def test_ctrl_c_stops_the_reply_and_the_server_aborts_it(server_url: str, terminal) -> None:
    term = terminal("--url", server_url, "--extra-body", '{"ignore_eos": true}')
    term.expect(PROMPT)
    term.line("/max 4000")  # minutes of tokens on a CPU: the reply is still going when ^C comes
    term.expect(PROMPT)
    term.line("tell me a long story")
    term.expect("tell me a long story\n")
    # Text on the screen while the request still runs: the reply streams.
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while num_requests_running(server_url) != 1 or len(term.screen) < term.position + 8:
        assert time.monotonic() < deadline, "the reply did not start streaming"
        term.read(0.1)
    term.type("\x03")
    interrupted_at = time.monotonic()
    while num_requests_running(server_url) != 0:
        assert time.monotonic() - interrupted_at < REPLY_TIMEOUT_S, "the server kept generating"
        time.sleep(0.05)  # paces the poll
    abort_s = time.monotonic() - interrupted_at
    stats = term.expect(STATS, timeout_s=10)
    assert "interrupted" in stats.group(4)
    num_shown = int(stats.group(2))
    assert 0 < num_shown < 4000
    # Aborted, not finished: at the rate the reply streamed, the rest of its 4,000 tokens would
    # take far longer than the server took to stop (a bound that scales with the machine).
    rate = float(re.search(r"([\d.]+) tokens/s", stats.group(0)).group(1))
    assert abort_s < ABORT_SHARE_OF_THE_REST * (4000 - num_shown) / rate, (abort_s, rate)
    term.expect(PROMPT)
    # The client goes on: the next reply includes the partial one in its prompt.
    term.line("/max 3")
    term.expect(PROMPT)
    stats = term.stats_after("hello")
    assert int(stats.group(2)) == 3
    assert int(stats.group(3)) > 2 * HELLO_PROMPT_TOKENS
    # Ctrl-C at the prompt quits. Wait for readline to wait for keys first: CPython's readline
    # loop checks for signals only when its select() is interrupted, so a SIGINT that lands
    # between the prompt being drawn and select() starting is noticed only at the next key (a
    # race no typist hits).
    term.wait_for_key_wait()
    term.type("\x03")
    assert term.wait_exit() == 0
    assert "Traceback" not in term.screen


def test_reset_clears_the_conversation(server_url: str, terminal) -> None:
    term = terminal("--url", server_url, "--max-tokens", "4")
    term.expect(PROMPT)
    first = term.stats_after("hello")
    assert int(first.group(3)) == HELLO_PROMPT_TOKENS
    second = term.stats_after("hello")
    assert int(second.group(3)) > 2 * HELLO_PROMPT_TOKENS  # both turns and the first reply
    term.line("/history")
    term.expect("4 messages")
    term.expect("user: hello")
    term.expect(PROMPT)
    term.line("/reset")
    term.expect("conversation cleared")
    term.line("/history")
    term.expect("0 messages")
    third = term.stats_after("hello")
    assert int(third.group(3)) == HELLO_PROMPT_TOKENS
    term.line("/quit")
    assert term.wait_exit() == 0


def test_system_prompt_and_settings(server_url: str, terminal) -> None:
    term = terminal("--url", server_url, "--max-tokens", "2")
    term.expect(PROMPT)
    term.line("/system be brief")
    term.expect("system prompt: be brief")
    stats = term.stats_after("hello")
    # <|im_start|> "system\n" "be brief" <|im_end|> "\n" before the user turn.
    assert int(stats.group(3)) == HELLO_PROMPT_TOKENS + 1 + 7 + 8 + 1 + 1
    term.line("/temp hot")
    term.expect("error: /temp takes a number ≥ 0, e.g. 0.7, got 'hot'")
    term.line("/max 0")
    term.expect("error: /max takes a whole number ≥ 1, e.g. 256, got '0'")
    term.line("/frobnicate")
    term.expect("error: unknown command /frobnicate; /help lists the commands")
    term.line("/help")
    term.expect("/raw")
    term.expect(PROMPT)
    term.line("/quit")
    assert term.wait_exit() == 0


def test_server_error_is_one_line_and_the_client_goes_on(server_url: str, terminal) -> None:
    term = terminal("--url", server_url)
    term.expect(PROMPT)
    term.line("/max 100000")  # more than the model's 4096 positions: the server answers 400
    term.expect(PROMPT)
    term.line("hello")
    error = term.expect(re.compile(r"error: server error 400: ([^\n]+)(?=\n)"))
    assert "max_tokens" in error.group(1) or "4096" in error.group(1), error.group(0)
    term.expect(PROMPT)
    term.line("/history")
    term.expect("0 messages")  # the unanswered message is not kept
    term.line("/max 2")
    term.expect(PROMPT)
    stats = term.stats_after("hello")
    assert int(stats.group(3)) == HELLO_PROMPT_TOKENS
    term.line("/quit")
    assert term.wait_exit() == 0
    assert "Traceback" not in term.screen


def test_unreachable_server_is_one_line_and_the_client_goes_on(terminal) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    term = terminal("--url", url)
    term.expect(f"error: cannot reach {url} (Connection refused); is the server running?")
    term.expect(PROMPT)
    term.line("hello")
    term.expect(f"error: cannot reach {url}")
    term.expect(PROMPT)
    term.line("/history")
    term.expect("0 messages")
    term.line("/quit")
    assert term.wait_exit() == 0
    assert "Traceback" not in term.screen


def test_raw_mode_continues_the_text(server_url: str, terminal) -> None:
    term = terminal("--url", server_url, "--max-tokens", "5", "--extra-body", '{"ignore_eos": 1}')
    term.expect(PROMPT)
    term.line("/raw")
    term.expect("raw completion mode")
    term.expect("\nraw> ")
    term.line("def f(x):")
    stats = term.expect(STATS)
    assert int(stats.group(3)) == len("def f(x):")  # one token per byte, no chat template
    assert int(stats.group(2)) == 5
    term.expect("\nraw> ")
    term.line("")  # an empty line: the model continues its own text
    stats = term.expect(STATS)
    assert int(stats.group(3)) > len("def f(x):")
    term.expect("\nraw> ")
    term.line("/history")
    term.expect(re.compile(r"raw text \(\d+ characters\):\ndef f\(x\):"))
    term.line("/raw")
    term.expect("chat mode")
    term.expect(PROMPT)
    term.line("/quit")
    assert term.wait_exit() == 0


def test_wrong_api_key_is_one_line(server_url: str, terminal) -> None:
    term = terminal("--url", server_url, "--api-key", "wrong-key")
    term.expect(
        re.compile(r"error: server error 401: [^\n]+ \(set --api-key or NANOSERVE_API_KEY\)")
    )
    term.expect(PROMPT)
    term.line("hello")
    term.expect("error: server error 401: ")
    term.expect(PROMPT)
    term.line("/quit")
    assert term.wait_exit() == 0
    assert "Traceback" not in term.screen


@pytest.fixture(scope="module")
def small_context_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server whose model has a 256-token context, served without an API key."""
    tmp = tmp_path_factory.mktemp("small_context")
    model = make_tiny_checkpoint(tmp / "model", "qwen3", max_position_embeddings=256)
    with InProcessServer(model, tmp / "server.log") as server:
        yield server.url


@pytest.fixture
def session(small_context_url: str) -> Iterator[ChatSession]:
    """A chat session in this process (what `nanoserve chat` runs) against the small model."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server = OpenAIServer(small_context_url, None, 30)
    try:
        yield ChatSession(server, parser.parse_args(["--temperature", "0"]), use_color=False)
    finally:
        server.close()


def test_a_reply_leaves_room_for_the_next_turn(session: ChatSession) -> None:
    body = session.request_body(messages=[{"role": "user", "content": "hi"}])
    assert session.max_model_len == 256
    assert body["max_tokens"] == 64  # a quarter of the context
    session.max_tokens = 10  # /max 10
    assert session.request_body(prompt="x")["max_tokens"] == 10


def test_max_alone_restores_the_default_that_help_and_chat_help_describe(
    session: ChatSession, capsys: pytest.CaptureFixture[str]
) -> None:
    session.command("/max 10")
    assert session.request_body(prompt="x")["max_tokens"] == 10
    session.command("/max")
    assert session.request_body(prompt="x")["max_tokens"] == 64  # the default, not the server's
    said = capsys.readouterr().out.splitlines()[-1]
    assert said == f"max tokens per reply: 64 (the default: {DEFAULT_REPLY_LIMIT})"
    session.command("/help")
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"/max alone: the default, {DEFAULT_REPLY_LIMIT}" in help_text
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    assert f"(default: {DEFAULT_REPLY_LIMIT})" in " ".join(parser.format_help().split())


def test_a_message_that_cannot_fit_alone_keeps_the_conversation(session: ChatSession) -> None:
    session.max_tokens = 4
    session.chat("hello")
    session.chat("hello again")
    before = list(session.messages)
    assert len(before) == 4
    with pytest.raises(ClientError, match="do not fit the model's context on their own") as e:
        session.chat("x" * 300)  # 300 byte tokens: more than the 256-token context alone
    assert "the conversation is kept" in str(e.value)
    assert session.messages == before and session.num_dropped_exchanges == 0


def test_a_conversation_that_outgrows_the_context_drops_its_oldest_turns(
    small_context_url: str, terminal
) -> None:
    term = terminal("--url", small_context_url, "--extra-body", '{"ignore_eos": true}')
    term.expect(PROMPT)
    message = "tell me more about it, " * 3  # 69 bytes: 88 prompt tokens with the template
    for _ in range(4):  # an exchange takes over 150 of the 256 tokens: the second must drop one
        stats = term.stats_after(message)
        assert int(stats.group(2)) == 64  # the default reply length: a quarter of the context
    # Each message after the first drops an exchange (or two), counted across messages.
    dropped = r"dropped (?:the|\d+) oldest exchanges? \((\d+) so far"
    counts = [int(n) for n in re.findall(dropped, term.screen)]
    assert len(counts) >= 2 and counts == sorted(set(counts)), term.screen
    term.line("/history")
    num_messages = int(term.expect(re.compile(r"(\d+) messages")).group(1))
    assert num_messages in (2, 4, 6)  # whole exchanges, fewer than the 8 sent and received
    term.line("/quit")
    assert term.wait_exit() == 0
    assert "error" not in term.screen and "Traceback" not in term.screen
