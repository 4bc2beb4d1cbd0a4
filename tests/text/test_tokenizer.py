from __future__ import annotations

import json
import random
from pathlib import Path

import huggingface_hub.constants
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.text.byte_tokenizer import save_byte_level_tokenizer
from nanoserve.text.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    load_tokenizer,
)

IM_START, IM_END = 257, 258
MULTIBYTE_TEXT = "héllo wörld 日本語 🙂"


@pytest.fixture(scope="module")
def byte_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("byte_tokenizer")
    save_byte_level_tokenizer(directory)
    return directory


@pytest.fixture()
def tokenizer(byte_tokenizer_dir: Path) -> PreTrainedTokenizerFast:
    return load_tokenizer(byte_tokenizer_dir)


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    tokenizer: PreTrainedTokenizerFast,
    token_ids: list[int],
    params: SamplingParams | None = None,
    chunk_size: int = 1,
    prompt: str = "Q: ",
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `token_ids` in chunks, then flush unless a stop string ended it; return increments."""
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), params or SamplingParams())
    increments = []
    for i in range(0, len(token_ids), chunk_size):
        increments.append(detok.update(token_ids[i : i + chunk_size]))
    increments.append(detok.flush())
    return detok, increments


# --- loading ---------------------------------------------------------------------------------


def test_load_tokenizer_local_dir(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.is_fast
    assert encode(tokenizer, "hé") == [104, 0xC3, 0xA9]
    assert tokenizer.eos_token_id == IM_END


def test_load_tokenizer_dir_without_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer files .* missing"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")


def test_load_tokenizer_unknown_hub_id_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="nanoserve-test/no-such-model.*missing"):
        load_tokenizer("nanoserve-test/no-such-model")


# --- chat templates --------------------------------------------------------------------------


def chatml(tokenizer: PreTrainedTokenizerFast, user_text: str) -> list[int]:
    return (
        [IM_START]
        + encode(tokenizer, "user\n" + user_text)
        + [IM_END]
        + encode(tokenizer, "\n")
        + [IM_START]
        + encode(tokenizer, "assistant\n")
    )


def test_chat_template_string_content(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hi 日本"}])
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == chatml(tokenizer, "hi 日本")


def test_chat_template_text_parts(tokenizer: PreTrainedTokenizerFast) -> None:
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": parts}])
    assert ids == chatml(tokenizer, "hello\nworld")


def test_chat_template_rejects_non_text_parts(tokenizer: PreTrainedTokenizerFast) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ValueError, match="only text content parts.*'image_url'"):
        apply_chat_template(tokenizer, [{"role": "user", "content": parts}])


def test_chat_template_without_generation_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = apply_chat_template(
        tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=False
    )
    assert ids == [IM_START] + encode(tokenizer, "user\nhi") + [IM_END] + encode(tokenizer, "\n")


def test_missing_chat_template(tokenizer: PreTrainedTokenizerFast) -> None:
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="this model has no chat template; pass --chat-template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"


def test_chat_template_override_from_string(byte_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(byte_tokenizer_dir, chat_template=TEMPLATE)
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert ids == encode(tokenizer, "[user:hi]")


def test_chat_template_override_from_jinja_file(byte_tokenizer_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    tokenizer = load_tokenizer(byte_tokenizer_dir, chat_template=str(path))
    assert apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}]) == encode(
        tokenizer, "[user:hi]"
    )
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(byte_tokenizer_dir, chat_template=str(tmp_path / "missing.jinja"))


def test_chat_template_argument_and_kwargs_pass_through(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    template = "{{ 'think' if enable_thinking else 'nothink' }}:{{ messages[0]['content'] }}"
    messages = [{"role": "user", "content": "x"}]
    ids = apply_chat_template(tokenizer, messages, chat_template=template, enable_thinking=False)
    assert ids == encode(tokenizer, "nothink:x")
    ids = apply_chat_template(tokenizer, messages, chat_template=template, enable_thinking=True)
    assert ids == encode(tokenizer, "think:x")


# --- incremental detokenization --------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7])
def test_multibyte_streaming_never_splits_characters(
    tokenizer: PreTrainedTokenizerFast, chunk_size: int
) -> None:
    token_ids = encode(tokenizer, MULTIBYTE_TEXT)
    assert len(token_ids) > len(MULTIBYTE_TEXT)  # multi-byte characters span several tokens
    detok, increments = stream(tokenizer, token_ids, chunk_size=chunk_size)
    assert all("\ufffd" not in inc for inc in increments)
    assert "".join(increments) == tokenizer.decode(token_ids) == MULTIBYTE_TEXT
    assert detok.output_text == MULTIBYTE_TEXT
    assert detok.stop_reason is None and not detok.is_stopped
    # Every character shows up as soon as its last byte arrives.
    if chunk_size == 1:
        assert increments[token_ids.index(0xF0) + 3] == "🙂"


def test_flush_emits_incomplete_character_as_replacement(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    token_ids = encode(tokenizer, "ab日")[:-1]  # the last byte of 日 never comes
    detok, increments = stream(tokenizer, token_ids)
    assert increments == ["a", "b", "", "", "\ufffd"]
    assert detok.output_text == tokenizer.decode(token_ids) == "ab\ufffd"


def test_decode_window_stays_small(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "x" * 100), SamplingParams())
    window_sizes = []
    decode = detok._decode

    def recording_decode(token_ids: list[int]) -> str:
        window_sizes.append(len(token_ids))
        return decode(token_ids)

    detok._decode = recording_decode  # type: ignore[method-assign]
    text = MULTIBYTE_TEXT * 50
    for token_id in encode(tokenizer, text):
        detok.update([token_id])
    detok.flush()
    assert detok.output_text == text
    assert max(window_sizes) <= 10


def test_invalid_bytes_are_emitted_as_replacement_chars(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    token_ids = [0x80] * 30 + encode(tokenizer, "ok 日")  # lone continuation bytes never complete
    detok, increments = stream(tokenizer, token_ids)
    assert "".join(increments) == tokenizer.decode(token_ids) == "\ufffd" * 30 + "ok 日"
    assert max(len(inc) for inc in increments) <= 10  # emitted in bounded pieces, not held forever


def test_update_after_flush_is_an_error(tokenizer: PreTrainedTokenizerFast) -> None:
    detok, _ = stream(tokenizer, encode(tokenizer, "abc"))
    with pytest.raises(RuntimeError, match="after flush"):
        detok.update([100])


# --- stop strings ----------------------------------------------------------------------------


def assert_no_leak(increments: list[str], final_text: str) -> None:
    """Every prefix of the stream must be a prefix of the final text: nothing was taken back."""
    shown = ""
    for increment in increments:
        shown += increment
        assert final_text.startswith(shown), (shown, final_text)
    assert shown == final_text


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 100])
@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("Hello STOP world", "STOP", "Hello "),
        ("a ST b STO c STOP d", "STOP", "a ST b STO c "),
        ("日本 語語 日本語です", "日本語", "日本 語語 "),
        ("abc<end>", "<end>", "abc"),
        ("STOPx", "STOP", ""),
    ],
)
def test_stop_string_spanning_tokens_never_leaks(
    tokenizer: PreTrainedTokenizerFast, text: str, stop: str, expected: str, chunk_size: int
) -> None:
    detok, increments = stream(
        tokenizer, encode(tokenizer, text), SamplingParams(stop=[stop]), chunk_size
    )
    assert all(stop[:2] not in inc for inc in increments if stop[:2] not in expected)
    assert_no_leak(increments, expected)
    assert detok.stop_reason == stop and detok.is_stopped
    assert detok.output_text == expected
    assert detok.update(encode(tokenizer, "more")) == ""
    assert detok.output_text == expected


def test_stop_prefix_is_released_once_it_cannot_match(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    assert [detok.update([t]) for t in encode(tokenizer, "aSTx")] == ["a", "", "", "STx"]
    assert detok.output_text == "aSTx"


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_include_stop_str_in_output(tokenizer: PreTrainedTokenizerFast, chunk_size: int) -> None:
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    detok, increments = stream(tokenizer, encode(tokenizer, "Hi STOP there"), params, chunk_size)
    assert_no_leak(increments, "Hi STOP")
    assert detok.stop_reason == "STOP"
    assert detok.output_text == "Hi STOP"


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
@pytest.mark.parametrize(
    ("stops", "text", "reason", "expected"),
    [
        (["world", "lo w"], "hello world", "lo w", "hel"),
        (["lo w", "world"], "hello world", "lo w", "hel"),
        # The stop string that is complete first wins, however the text was split into tokens.
        (["abcd", "bc"], "xabcdy", "bc", "xa"),
        # One stop string is a prefix of another: the shorter one is complete first.
        (["abc", "ab"], "xabcd", "ab", "x"),
        # Same end: the longer one wins.
        (["bc", "abc"], "xabcd", "abc", "x"),
    ],
)
def test_multiple_stop_strings(
    tokenizer: PreTrainedTokenizerFast,
    stops: list[str],
    text: str,
    reason: str,
    expected: str,
    chunk_size: int,
) -> None:
    detok, increments = stream(
        tokenizer, encode(tokenizer, text), SamplingParams(stop=stops), chunk_size
    )
    assert_no_leak(increments, expected)
    assert (detok.stop_reason, detok.output_text) == (reason, expected)


def test_stop_prefix_of_another_included(tokenizer: PreTrainedTokenizerFast) -> None:
    params = SamplingParams(stop=["abc", "ab"], include_stop_str_in_output=True)
    detok, increments = stream(tokenizer, encode(tokenizer, "xabcd"), params)
    assert_no_leak(increments, "xab")
    assert detok.stop_reason == "ab"


def test_flush_emits_held_back_text_without_match(tokenizer: PreTrainedTokenizerFast) -> None:
    detok, increments = stream(
        tokenizer, encode(tokenizer, "Hello ST"), SamplingParams(stop=["STOP", "Hello!"])
    )
    assert "".join(increments[:-1]) == "Hello "  # "ST" might still have become "STOP"
    assert increments[-1] == "ST"
    assert detok.output_text == "Hello ST"
    assert detok.stop_reason is None and not detok.is_stopped


@pytest.mark.parametrize(
    ("skip_special_tokens", "expected"),
    [(True, "ab\ncd"), (False, "ab<|im_end|>\n<|im_start|>cd")],
)
def test_skip_special_tokens(
    tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool, expected: str
) -> None:
    token_ids = encode(tokenizer, "ab") + [IM_END] + encode(tokenizer, "\n") + [IM_START]
    token_ids += encode(tokenizer, "cd")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok, increments = stream(tokenizer, token_ids, params, prompt="<|im_start|>assistant\n")
    assert "".join(increments) == detok.output_text == expected
    assert expected == tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_stop_string_matching_special_token_text(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = encode(tokenizer, "ab") + [IM_END] + encode(tokenizer, "cd")
    params = SamplingParams(stop=["<|im_end|>"], skip_special_tokens=False)
    detok, increments = stream(tokenizer, token_ids, params)
    assert_no_leak(increments, "ab")
    assert detok.stop_reason == "<|im_end|>"


# --- a real BPE tokenizer with merges --------------------------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Streaming detokenization must never split a character: héllo wörld, naïve café. ",
    "日本語のテキストも正しく表示されるべきです。日本語、日本、本語。 ",
    "Emoji too 🙂🙂 and 🚀 rockets; tabs\tand\nnewlines  with   spaces. ",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
]


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    assert tokenizer.get_vocab_size() > 400  # it learned merges
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


# Characters unseen in training whose first bytes were merged: tokens end inside a character,
# some after complete text (" " + half an emoji).
UNSEEN_TEXT = "早 旦 暮 日曜日 🚁 😀 unseen wörds 語日 🚀🙂 xyz  "


def test_bpe_tokens_end_inside_characters(bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    """The trained tokenizer really splits characters mid-token, so the test below bites."""
    pieces = [bpe_tokenizer.decode([i]) for i in encode(bpe_tokenizer, UNSEEN_TEXT)]
    assert any(len(p) > 1 and p.endswith("\ufffd") and "\ufffd" not in p[:-1] for p in pieces)
    assert any(len(bpe_tokenizer.convert_ids_to_tokens(i)) > 1 for i in encode(bpe_tokenizer, "早"))


@pytest.mark.parametrize("chunk_size", [1, 2, 5])
@pytest.mark.parametrize("text", [*CORPUS, UNSEEN_TEXT, " leading space", "  ", MULTIBYTE_TEXT])
def test_bpe_incremental_decode_equals_full_decode(
    bpe_tokenizer: PreTrainedTokenizerFast, text: str, chunk_size: int
) -> None:
    token_ids = encode(bpe_tokenizer, text)
    detok, increments = stream(bpe_tokenizer, token_ids, chunk_size=chunk_size, prompt="Say: ")
    assert "".join(increments) == detok.output_text == bpe_tokenizer.decode(token_ids) == text
    assert all("\ufffd" not in inc for inc in increments)


def test_bpe_stop_string_across_merged_tokens(bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    params = SamplingParams(stop=["fox jumps", "zzz"])
    detok, increments = stream(bpe_tokenizer, encode(bpe_tokenizer, text), params)
    assert_no_leak(increments, "The quick brown ")
    assert detok.stop_reason == "fox jumps"


# --- a SentencePiece-style tokenizer (Llama, Mistral): Metaspace, byte fallback, strip ---------


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"])
    trainer.show_progress = False
    trained.train_from_iterator(CORPUS * 20, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    # Byte tokens <0x00>..<0xFF> are ordinary vocabulary entries, as in Llama's tokenizer.json.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in model["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),  # an incomplete byte sequence decodes to one U+FFFD per byte
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),  # the first token's space is dropped
        ]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")


@pytest.mark.parametrize("chunk_size", [1, 2, 5])
@pytest.mark.parametrize("text", [CORPUS[1], CORPUS[3], UNSEEN_TEXT, "Hello world"])
def test_sentencepiece_incremental_decode(
    sentencepiece_tokenizer: PreTrainedTokenizerFast, text: str, chunk_size: int
) -> None:
    tokenizer = sentencepiece_tokenizer
    token_ids = encode(tokenizer, text)
    assert "<0xE6>" in tokenizer.convert_ids_to_tokens(encode(tokenizer, UNSEEN_TEXT))
    prompt_ids = encode(tokenizer, "Say hi")
    detok, increments = stream(tokenizer, token_ids, chunk_size=chunk_size, prompt="Say hi")
    # The output continues the prompt, so its first "▁" is a real space.
    expected = tokenizer.decode(prompt_ids + token_ids)[len(tokenizer.decode(prompt_ids)) :]
    assert expected == " " + text
    assert "".join(increments) == detok.output_text == expected
    assert all("\ufffd" not in inc for inc in increments)


# --- stop strings under random text and random token boundaries --------------------------------


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The stop string complete first in `text` (ties: the longest) and the final output."""
    matches = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not matches:
        return text, None
    end, neg_len, stop = min(matches)
    return text[: end if include else end + neg_len], stop


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_random(tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab日 🙂\n"
    stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choices(alphabet, k=40))
    include = rng.random() < 0.5
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    token_ids = encode(tokenizer, text)
    expected, reason = reference_stop(text, stops, include)
    for chunk_size in (1, 2, 3, 8):
        detok, increments = stream(tokenizer, token_ids, params, chunk_size)
        assert_no_leak(increments, expected)
        assert detok.stop_reason == reason
        assert all("\ufffd" not in inc for inc in increments)
