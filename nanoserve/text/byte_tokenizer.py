"""A byte-level tokenizer with no merges: one token per byte, plus chat special tokens.

Tests and dummy-weight checkpoints need a real `tokenizer.json` without a hub download. Every
byte string round-trips through it, and multi-byte characters span several tokens, which is
exactly what the streaming detokenizer must handle. For a model with a larger vocabulary (a
dummy checkpoint of a real shape), the ids past the byte and special tokens are filler words
(" aa", " ab", ...) that text never encodes to, so that every id the model samples decodes to
visible text.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

NUM_BYTE_TOKENS = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML with Qwen2.5's tool calling: with `tools`, a system turn lists them and asks for
# `<tool_call>{"name": ..., "arguments": ...}</tool_call>`; assistant turns with tool_calls
# write them back that way, and tool results go in a user turn as `<tool_response>`s.
# Without tools and tool messages it renders plain ChatML.
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}"
    "{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_byte_level_tokenizer(vocab_size: int | None = None) -> Tokenizer:
    """Token id i (< 256) is byte i; special tokens follow at 256, 257, 258; with `vocab_size`,
    filler words take the ids from 259 up to it."""
    byte_to_char = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    # ByteLevel.alphabet() is unordered; rebuild GPT-2's byte -> unicode table to order it by byte.
    ordered = _bytes_to_unicode()
    assert set(ordered.values()) == set(byte_to_char)
    vocab = {ordered[b]: b for b in range(NUM_BYTE_TOKENS)}
    vocab.update({token: NUM_BYTE_TOKENS + i for i, token in enumerate(SPECIAL_TOKENS)})
    space = ordered[ord(" ")]
    filler_ids = range(len(vocab), vocab_size or 0)
    vocab.update({space + word: i for i, word in zip(filler_ids, _filler_words(), strict=False)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_byte_level_tokenizer(
    directory: str | Path, model_max_length: int = 4096, vocab_size: int | None = None
) -> None:
    """Write tokenizer.json and tokenizer_config.json (with a ChatML template) to `directory`."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_byte_level_tokenizer(vocab_size),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(directory))


def _filler_words() -> Iterator[str]:
    """'aa', 'ab', ..., 'zz', 'aaa', ...: as many distinct lowercase words as asked for."""
    for length in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            yield "".join(letters)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in printable:
            printable.append(b)
            chars.append(NUM_BYTE_TOKENS + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}
