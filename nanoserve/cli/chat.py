"""`nanoserve chat`: an interactive terminal client for any OpenAI-compatible server.

It streams each reply as it arrives (SSE from `/v1/chat/completions`, or `/v1/completions` in raw
mode), keeps the conversation, and after each reply prints a dim line with the time to first
token, the number of tokens and tokens/s. Ctrl-C during a reply closes the connection (the server
then aborts the request) and returns to the prompt; Ctrl-C or Ctrl-D at the prompt quits.

Only the standard library and httpx: the client never imports torch or the server.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanoserve.cli.chat_reply import ReplyStats, chat_text, completion_text, stream_reply
from nanoserve.cli.help_format import DefaultsHelpFormatter
from nanoserve.cli.openai_http_client import ClientError, OpenAIServer

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_HISTORY_FILE = "~/.nanoserve_chat_history"
# Without /max, a reply may take a quarter of the context (at most 512 tokens): the rest is
# left to the conversation, so that the next turn still fits.
REPLY_SHARE_OF_CONTEXT = 4
MAX_DEFAULT_REPLY_TOKENS = 512
# What /help, `chat --help` and `/max` alone say of that default: one text, so they agree.
DEFAULT_REPLY_LIMIT = (
    f"1/{REPLY_SHARE_OF_CONTEXT} of the model's context, at most {MAX_DEFAULT_REPLY_TOKENS} "
    "tokens, so that the next turn fits; the server's own limit where /v1/models does not "
    "say the context length"
)

_MAX_HELP = ("\n" + " " * 17).join(  # lines that start where each command's description does
    textwrap.wrap(
        f"at most N tokens per reply (/max alone: the default, {DEFAULT_REPLY_LIMIT})", 80
    )
)
HELP = f"""\
Type a message and press Enter. Ctrl-C stops a reply; Ctrl-C or Ctrl-D at the prompt quits.
  /reset         forget the conversation (and the raw-mode text)
  /system TEXT   set the system prompt (/system alone removes it)
  /temp X        sampling temperature, e.g. 0 for greedy (/temp alone: the server's default)
  /max N         {_MAX_HELP}
  /raw           switch raw completion mode on or off: what you type is appended to the text so
                 far and the model continues it (/v1/completions, for base models); an empty
                 line lets the model continue
  /history       show the conversation as it is sent
  /help          this help
  /quit          leave (also /exit)"""


class ChatSession:
    """The conversation, the settings the commands change, and the read-reply loop."""

    def __init__(self, server: OpenAIServer, args: argparse.Namespace, use_color: bool) -> None:
        self.server = server
        self.model: str | None = args.model
        self.system: str | None = args.system
        self.temperature: float | None = args.temperature
        self.max_tokens: int | None = args.max_tokens
        self.extra_body: dict[str, Any] = args.extra_body
        self.is_raw: bool = args.raw
        self.messages: list[dict[str, str]] = []  # user and assistant turns, no system prompt
        self.model_cards: list[dict[str, Any]] | None = None  # /v1/models, fetched once
        self.raw_text = ""  # raw mode: everything typed and generated so far
        self.use_color = use_color
        self.num_dropped_exchanges = 0  # left out to fit the context, since the last /reset

    # -- output

    def dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.use_color else text

    def info(self, text: str) -> None:
        print(self.dim(text), flush=True)

    def error(self, text: str) -> None:
        print(f"error: {text}", file=sys.stderr, flush=True)

    # -- the loop

    @property
    def prompt(self) -> str:
        return "raw> " if self.is_raw else "> "

    def run(self) -> int:
        self.info(f"nanoserve chat · {self.server.url} · /help for commands")
        try:
            self.info(f"model: {self.resolve_model()}")
        except ClientError as e:
            self.error(str(e))
        while True:
            try:
                line = input(self.prompt)
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            try:
                if not self.handle(line):
                    return 0
            except ClientError as e:
                self.error(str(e))
            except KeyboardInterrupt:
                print()
                self.info("interrupted")

    def handle(self, line: str) -> bool:
        """Run one line: a command or a message. False when the user asked to quit."""
        if line.startswith("/"):
            return self.command(line)
        if self.is_raw:
            self.complete_raw(line)
        elif line.strip():
            self.chat(line)
        return True

    def command(self, line: str) -> bool:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            print(HELP)
        elif name == "/reset":
            self.messages.clear()
            self.raw_text = ""
            self.num_dropped_exchanges = 0
            self.info("conversation cleared")
        elif name == "/system":
            self.system = arg or None
            self.info(f"system prompt: {arg}" if arg else "no system prompt")
        elif name == "/temp":
            self.temperature = _parse_number(arg, float, "/temp", "a number ≥ 0, e.g. 0.7")
            self.info(f"temperature: {_or_default(self.temperature)}")
        elif name == "/max":
            self.max_tokens = _parse_number(arg, int, "/max", "a whole number ≥ 1, e.g. 256")
            self.info(f"max tokens per reply: {self.describe_reply_limit()}")
        elif name == "/raw":
            self.is_raw = not self.is_raw
            self.info("raw completion mode (/raw again for chat)" if self.is_raw else "chat mode")
        elif name == "/history":
            self.show_history()
        else:
            self.error(f"unknown command {name}; /help lists the commands")
        return True

    def show_history(self) -> None:
        if self.is_raw:
            self.info(f"raw text ({len(self.raw_text)} characters):")
            print(self.raw_text)
            return
        self.info(f"{len(self.messages)} messages" + (" + system prompt" if self.system else ""))
        for message in self.request_messages():
            print(f"{message['role']}: {message['content']}")

    # -- requests

    def resolve_model(self) -> str:
        if self.model_cards is None:
            try:
                self.model_cards = self.server.list_models()
            except ClientError as e:
                if self.model is None:
                    raise
                self.model_cards = []
                self.info(
                    f"could not list the models ({e}); replies take the server's default length"
                )
        if self.model is None:
            if not self.model_cards:
                raise ClientError(f"{self.server.url} serves no models; give one with --model")
            self.model = self.model_cards[0]["id"]
        return self.model

    @property
    def max_model_len(self) -> int | None:
        """The model's context in tokens, when /v1/models says it (vLLM and nanoserve do)."""
        for card in self.model_cards or []:
            if card["id"] == self.model and isinstance(card.get("max_model_len"), int):
                return card["max_model_len"] or None
        return None

    @property
    def reply_max_tokens(self) -> int | None:
        """/max if set, else a share of the context that leaves room for the next turn."""
        if self.max_tokens is not None or self.max_model_len is None:
            return self.max_tokens
        return min(MAX_DEFAULT_REPLY_TOKENS, self.max_model_len // REPLY_SHARE_OF_CONTEXT)

    def describe_reply_limit(self) -> str:
        """The reply limit in force: /max's, or the default's number and what it is."""
        if self.max_tokens is not None:
            return str(self.max_tokens)
        limit = self.reply_max_tokens
        if limit is None:
            return "the server's own (/v1/models does not say the context length)"
        return f"{limit} (the default: {DEFAULT_REPLY_LIMIT})"

    def request_messages(
        self, messages: list[dict[str, str]] | None = None
    ) -> list[dict[str, str]]:
        """The system prompt, if any, then `messages` (default: the conversation)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + (self.messages if messages is None else messages)

    def request_body(self, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.resolve_model(), **fields, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.reply_max_tokens is not None:
            body["max_tokens"] = self.reply_max_tokens
        return {**body, **self.extra_body}

    def chat(self, text: str) -> None:
        """Send the conversation and `text`; while they outgrow the context, send them again
        without the oldest exchange. Those left out are dropped once the server takes the
        request: a message that cannot fit even alone leaves the conversation as it was."""
        question = {"role": "user", "content": text}
        num_left_out = 0  # exchanges, from the oldest
        while True:
            kept = self.messages[2 * num_left_out :]
            body = self.request_body(messages=[*self.request_messages(kept), question])
            try:
                drop_left_out = functools.partial(self.drop, num_left_out)
                reply, stats = self.stream_reply(
                    "/v1/chat/completions", body, chat_text, drop_left_out
                )
                break
            except ClientError as e:
                if not e.is_context_overflow:
                    raise
                if not kept:
                    raise ClientError(
                        f"{e} (this message and a reply of up to {self.reply_max_tokens} tokens "
                        "do not fit the model's context on their own: shorten it or lower /max; "
                        "the conversation is kept)"
                    ) from None
                num_left_out += 1
        # An unanswered message (error, or ^C before any text) is left out, so that the user can
        # send it again; an interrupted reply is kept as far as it was shown.
        if reply or not stats.is_interrupted:
            self.messages += [question, {"role": "assistant", "content": reply}]

    def drop(self, num_exchanges: int) -> None:
        """Forget the oldest exchanges (the server took the conversation without them)."""
        if num_exchanges == 0:
            return
        del self.messages[: 2 * num_exchanges]
        self.num_dropped_exchanges += num_exchanges
        what = "the oldest exchange" if num_exchanges == 1 else f"{num_exchanges} oldest exchanges"
        self.info(
            f"the conversation outgrew the model's context ({self.max_model_len} tokens): "
            f"dropped {what} ({self.num_dropped_exchanges} so far; /reset forgets all)"
        )

    def complete_raw(self, text: str) -> None:
        body = self.request_body(prompt=self.raw_text + text)
        print(self.dim(text), end="", flush=True)  # so that the continuation reads on from it
        try:
            continuation, _ = self.stream_reply("/v1/completions", body, completion_text)
        except ClientError as e:
            if text:
                print()  # the error goes on a line of its own
            if e.is_context_overflow:
                raise ClientError(
                    f"{e} (the text outgrew the context: /reset starts afresh)"
                ) from None
            raise
        self.raw_text += text + continuation

    def stream_reply(
        self,
        path: str,
        body: dict[str, Any],
        text_of: Callable[[dict[str, Any]], tuple[str, str]],
        on_accepted: Callable[[], None] = lambda: None,
    ) -> tuple[str, ReplyStats]:
        """Print a streamed reply as it comes, then its stats line; its text and stats.
        `on_accepted` runs when the server's first chunk arrives, before any text."""
        text, stats = stream_reply(self.server, path, body, text_of, self.dim, on_accepted)
        self.info(stats.describe())
        return text, stats


def _parse_number(text: str, kind: type, command: str, allowed: str) -> Any:
    """`text` as an int or float (None when empty); ClientError naming what is allowed."""
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise ClientError(f"{command} takes {allowed}, got {text!r}") from None
    if value < (1 if kind is int else 0):
        raise ClientError(f"{command} takes {allowed}, got {text!r}")
    return value


def _or_default(value: Any) -> str:
    return "the server's default" if value is None else str(value)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'must be a JSON object like {{"top_k": 20}}: {text!r}')
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help="the server's base URL")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("NANOSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $NANOSERVE_API_KEY or $OPENAI_API_KEY)",
    )
    parser.add_argument("--model", help="model name (default: the first one the server lists)")
    parser.add_argument("--system", help="system prompt (default: none)")
    parser.add_argument(
        "--temperature", type=float, help="sampling temperature (default: the server's own)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        help=f"most tokens per reply; /max changes it (default: {DEFAULT_REPLY_LIMIT})",
    )
    parser.add_argument("--raw", action="store_true", help="start in raw completion mode")
    parser.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help='fields merged into every request, e.g. \'{"top_k": 20, "ignore_eos": true}\'',
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the server to answer"
    )
    parser.add_argument(
        "--history-file",
        default=DEFAULT_HISTORY_FILE,
        help="where readline keeps the lines you typed ('' for none)",
    )


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `nanoserve chat` on the `nanoserve` command's subparsers."""
    parser = subparsers.add_parser(
        "chat",
        help="chat with a running server in the terminal",
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(handler=run_chat, command_parser=parser)


def _setup_readline(history_file: str) -> Callable[[], None]:
    """Line editing and history for input(); returns what saves the history at exit."""
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline: input() still works, unedited
        return lambda: None
    if not history_file:
        return lambda: None
    path = Path(history_file).expanduser()
    try:
        readline.read_history_file(path)
    except FileNotFoundError:
        pass  # the first run
    except OSError as e:
        print(f"warning: cannot read the history file {path}: {e}", file=sys.stderr)
    readline.set_history_length(1000)

    def save() -> None:
        try:
            readline.write_history_file(path)
        except OSError as e:
            print(f"warning: cannot write the history file {path}: {e}", file=sys.stderr)

    return save


def run_chat(args: argparse.Namespace) -> int:
    if args.max_tokens is not None and args.max_tokens < 1:
        print(f"--max-tokens must be ≥ 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    use_color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    save_history = _setup_readline(args.history_file) if sys.stdin.isatty() else lambda: None
    server = OpenAIServer(args.url, args.api_key, args.timeout)
    try:
        return ChatSession(server, args, use_color).run()
    finally:
        server.close()
        save_history()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nanoserve chat",
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    add_arguments(parser)
    return run_chat(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
