"""Text in and text out: tokenizer loading, chat templates, streaming detokenization, stop strings.

The worker only sees token ids; everything here runs in the front process (or in `LLM`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanoserve.common.sampling_params import SamplingParams

# Tokens of the prompt's tail decoded together with the first output tokens, so that decoders
# which treat the first token specially (SentencePiece's leading space) see the right context.
INITIAL_PREFIX_TOKENS = 5
# More pending tokens than this with no complete character boundary among the last few are not a
# character being spelled out (UTF-8 needs at most 4 bytes) but invalid bytes: emit them as is.
MAX_PENDING_TOKENS = 8
REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(
    path_or_id: str | Path, chat_template: str | None = None
) -> PreTrainedTokenizerBase:
    """Load the fast tokenizer of a local checkpoint directory or a Hugging Face hub id.

    `chat_template` replaces the checkpoint's template: a Jinja template string or the path of a
    `.jinja` file.
    """
    name = str(path_or_id)
    local_path = Path(name).expanduser()
    looks_like_path = local_path.exists() or name.startswith(("/", ".", "~"))
    if looks_like_path and not local_path.is_dir():
        raise ValueError(f"model path {name!r} is not a directory of a Hugging Face checkpoint")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local_path) if looks_like_path else name)
    except (OSError, ValueError) as exc:
        where = "in that directory" if looks_like_path else "locally or on the hub (offline?)"
        raise ValueError(
            f"could not load a tokenizer for {name!r}: tokenizer files (tokenizer.json, "
            f"tokenizer_config.json) are missing {where}: {exc}"
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{name!r} has no fast tokenizer (tokenizer.json); only fast ones work")
    if chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(chat_template)
    return tokenizer


def resolve_chat_template(chat_template: str | Path) -> str:
    """Return the template text of `chat_template`: a `.jinja` file path or a template itself."""
    if isinstance(chat_template, Path) or chat_template.endswith((".jinja", ".jinja2")):
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise ValueError(f"chat template file {str(path)!r} does not exist")
        return path.read_text()
    if "{" not in chat_template and Path(chat_template).expanduser().is_file():
        return Path(chat_template).expanduser().read_text()
    return chat_template


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Render `messages` with the chat template and return the prompt's token ids.

    Message content may be a string or a list of `{"type": "text", "text": ...}` parts (joined
    with newlines). `chat_template` is template text that replaces the tokenizer's (never a file
    name: files are read by `load_tokenizer` only). Extra keyword arguments reach the template
    (e.g. `enable_thinking=False`).
    """
    text = render_chat_template(
        tokenizer, messages, add_generation_prompt, chat_template, **template_kwargs
    )
    # The template already wrote any BOS/special tokens, so the encoder must not add more.
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text of `messages` (see `apply_chat_template`), not yet tokenized."""
    if chat_template is None and not tokenizer.chat_template:
        raise ValueError(
            "this model has no chat template; pass --chat-template with a template string or a "
            ".jinja file, or use /v1/completions with a plain prompt"
        )
    # Render to text (`tokenize=True` returns a BatchEncoding in transformers 5).
    text = tokenizer.apply_chat_template(
        [_normalise_message(m) for m in messages],
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )
    assert isinstance(text, str)  # one conversation renders to one string
    return text


def _normalise_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type != "text":
            raise ValueError(f"only text content parts are supported, got type {part_type!r}")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


class IncrementalDetokenizer:
    """Turns one request's stream of output token ids into text deltas and applies stop strings.

    Decoding uses vLLM's two offsets over the token ids: `prefix_offset..read_offset` is text
    already returned, kept only as context; `read_offset..` is new. Each update decodes just that
    window, so the cost per token does not grow with the output. New text is held back while it
    ends in U+FFFD (a character whose remaining bytes are in tokens still to come).

    Stop strings: the first stop string to appear in the text (ties: the longest) ends the
    output, whatever the token boundaries. Text that could still be the start of a stop string is
    held back until it cannot, so no part of a stop string is ever returned unless
    `include_stop_str_in_output`.

    `output_text` is all text returned so far by `update` and `flush`; after `flush` or a stop it
    is the final completion text. `stop_reason` is the matched stop string, or None.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        # Token ids from the prompt's tail on; only the window from prefix_offset is decoded.
        self._token_ids = list(prompt_token_ids[-INITIAL_PREFIX_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._emitted_parts: list[str] = []  # text returned so far, joined on demand
        self._held_text = ""  # decoded text not returned yet: it may start a stop string
        self.stop_reason: str | None = None
        self.is_stopped = False
        self._is_flushed = False

    @property
    def output_text(self) -> str:
        """All text returned so far; the final completion text after a stop or `flush`."""
        if len(self._emitted_parts) > 1:
            self._emitted_parts = ["".join(self._emitted_parts)]
        return self._emitted_parts[0] if self._emitted_parts else ""

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stops)

    def update(self, new_token_ids: list[int]) -> str:
        """Add newly generated tokens; return the text that is now safe to show."""
        if self._is_flushed:
            raise RuntimeError("update() called after flush(): generation had already ended")
        if self.is_stopped:
            return ""
        self._token_ids.extend(new_token_ids)
        return self._advance(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of generation: return all held-back text (an incomplete character as U+FFFD)."""
        if self.is_stopped or self._is_flushed:
            return ""
        self._is_flushed = True
        return self._advance(self._decode_new(final=True), final=True)

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:  # skips transformers' clean-up of spaces, which is lossy
            return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        text = self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def _decode_new(self, final: bool) -> str:
        """Text of the new tokens up to the last complete character (all of it when final)."""
        num_tokens = len(self._token_ids)
        if self._read_offset == num_tokens:
            return ""
        found = None if final else self._complete_window_end()
        if found is None:
            if not final and num_tokens - self._read_offset <= MAX_PENDING_TOKENS:
                return ""  # wait for the rest of the character
            # The end of generation, or invalid bytes: emit as decoded, with U+FFFD.
            found = num_tokens, self._decode(self._token_ids[self._prefix_offset :])
        end, text = found
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        if len(text) <= len(prefix_text):
            return ""  # nothing visible yet, e.g. a skipped special token
        self._prefix_offset, self._read_offset = self._read_offset, end
        return text[len(prefix_text) :]

    def _complete_window_end(self) -> tuple[int, str] | None:
        """The last window end whose text ends in a complete character, and that text."""
        num_tokens = len(self._token_ids)
        # An incomplete character's bytes lie in the last 3 tokens at most (a token holds at
        # least one byte), so one of these ends is complete unless the bytes are invalid.
        for end in range(num_tokens, max(self._read_offset, num_tokens - 4), -1):
            text = self._decode(self._token_ids[self._prefix_offset : end])
            if not text.endswith(REPLACEMENT_CHAR):
                return end, text
        return None

    def _advance(self, new_text: str, final: bool) -> str:
        """Add `new_text` to the held text, look for stop strings, and return what can be shown."""
        # No stop string can start in text already returned (it was not a possible stop prefix),
        # so the search covers the held text only, which stays shorter than the longest stop
        # string plus the new text.
        text = self._held_text + new_text
        num_shown_chars = len(text)
        match = self._find_stop(text) if self._stops else None
        if match is not None:
            start, stop = match
            self.stop_reason, self.is_stopped = stop, True
            num_shown_chars = start + len(stop) if self._include_stop else start
        elif not final:
            num_shown_chars -= self._num_stop_prefix_chars(text)
        emitted, self._held_text = text[:num_shown_chars], text[num_shown_chars:]
        if self.is_stopped:
            self._held_text = ""
        if emitted:
            self._emitted_parts.append(emitted)
        return emitted

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that ends first in `text` (ties: the longest), and its start."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start != -1:
                candidate = (start + len(stop), -len(stop), stop)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[0] + best[1], best[2])

    def _num_stop_prefix_chars(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        held = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:length]):
                    held = length
                    break
        return held
