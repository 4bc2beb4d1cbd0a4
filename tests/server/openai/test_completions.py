"""/v1/completions against transformers: echo with the prompt's logprobs, vLLM's
`prompt_logprobs`, `max_tokens: 0`, streamed echo offsets, continuous usage, and lm-eval's
`local-completions` requests (loglikelihood, multiple choice, rolling) replayed as it sends
them and scored as it scores the answers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from servers import InProcessServer

from nanoserve.text.tokenizer import load_tokenizer

TOLERANCE = 2e-5  # fp32 on both sides
EOS = 258  # the tiny checkpoints' <|im_end|>: lm-eval's prefix token when there is no BOS


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return load_tokenizer(tiny_model)


def reference(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position: [N, vocab] (row j scores token j + 1)."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)


def complete(server: InProcessServer, body: dict) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server: InProcessServer, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


# ---- lm-eval's local-completions, as it sends requests and reads the answers ----


def lm_eval_payload(prompts: list[list[int]]) -> dict:
    """lm-eval's loglikelihood request: a batch of token-id prompts, echoed with logprobs."""
    return {
        "model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True,
    }  # fmt: skip


def lm_eval_scores(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's parse_logprobs: the continuation's logprob sum and whether it is greedy."""
    scores = []
    for choice, ctxlen in zip(
        sorted(response["choices"], key=lambda c: c["index"]), ctxlens, strict=True
    ):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(lp == max(t.values()) for lp, t in zip(logprobs, top, strict=True))
        scores.append((sum(logprobs), is_greedy))
    return scores


def hf_scores(hf_model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The same from transformers: log P(continuation | context), and greedy or not."""
    rows = reference(hf_model, context + continuation)[len(context) - 1 : -1]  # [C, vocab]
    targets = torch.tensor(continuation)
    logprob = rows.gather(1, targets.unsqueeze(1)).sum().item()
    return logprob, bool((rows.argmax(dim=-1) == targets).all())


def rolling_windows(tokens: list[int], prefix: int, max_len: int):
    """lm-eval's disjoint rolling windows: (context, continuation) pairs covering `tokens`.

    The first window predicts the first max_len tokens after the prefix token; each later
    one predicts up to max_len more, given the tokens before them (max_len + 1 in all).
    """
    windows = [([prefix], tokens[:max_len])]
    done = len(windows[0][1])
    while done < len(tokens):
        end = min(len(tokens), done + max_len)
        windows.append((tokens[end - max_len - 1 : done], tokens[done:end]))
        done = end
    return windows


def test_lm_eval_loglikelihood_and_multiple_choice_match_transformers(
    server: InProcessServer, hf_model, tokenizer
) -> None:
    context = tokenizer.encode("Question: which is a colour?\nAnswer:")
    options = [" red", " seven", " running quickly", " a"]
    requests = [(context, tokenizer.encode(option)) for option in options]
    expected = [hf_scores(hf_model, ctx, cont) for ctx, cont in requests]
    ctxlens = [len(ctx) for ctx, _ in requests]
    batched = lm_eval_scores(
        complete(server, lm_eval_payload([c + o for c, o in requests])), ctxlens
    )
    one_by_one = [
        lm_eval_scores(complete(server, lm_eval_payload([ctx + cont])), [len(ctx)])[0]
        for ctx, cont in requests
    ]
    for scores in (batched, one_by_one):  # the context's blocks are cached after the first
        assert [greedy for _, greedy in scores] == [greedy for _, greedy in expected]
        assert [s for s, _ in scores] == pytest.approx([s for s, _ in expected], abs=1e-4)
    best = max(range(len(options)), key=lambda i: expected[i][0])
    assert max(range(len(options)), key=lambda i: batched[i][0]) == best


def test_lm_eval_rolling_loglikelihood_matches_transformers(
    server: InProcessServer, hf_model, tokenizer
) -> None:
    tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again!")
    windows = rolling_windows(tokens, prefix=EOS, max_len=24)
    assert len(windows) == 3 and sum(len(cont) for _, cont in windows) == len(tokens)
    response = complete(server, lm_eval_payload([ctx + cont for ctx, cont in windows]))
    scores = lm_eval_scores(response, [len(ctx) for ctx, _ in windows])
    expected = [hf_scores(hf_model, ctx, cont)[0] for ctx, cont in windows]
    assert [s for s, _ in scores] == pytest.approx(expected, abs=1e-4)


# ---- echo and prompt logprobs ----


def assert_logprobs_close(got: dict, expected: dict, num_offsets: int | None = None) -> None:
    """Two legacy completions logprobs: same tokens and (the first num_offsets) text offsets,
    logprobs within TOLERANCE."""
    assert got["tokens"] == expected["tokens"]
    assert got["text_offset"][:num_offsets] == expected["text_offset"][:num_offsets]
    assert got["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=TOLERANCE)
    assert [t and set(t) for t in got["top_logprobs"]] == [
        t and set(t) for t in expected["top_logprobs"]
    ]
    for top, expected_top in zip(got["top_logprobs"], expected["top_logprobs"], strict=True):
        if top is not None:
            assert top == pytest.approx(expected_top, abs=TOLERANCE)


def test_echo_with_logprobs_scores_every_prompt_token(
    server: InProcessServer, hf_model, tokenizer
) -> None:
    prompt = [ord(c) for c in "def add(a, b):\n    return a + b\n"]  # ASCII: 1 char a token
    body = {**lm_eval_payload([prompt]), "max_tokens": 3, "logprobs": 2, "ignore_eos": True}
    [choice] = complete(server, body)["choices"]
    ids = torch.tensor([prompt])
    greedy = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3,
        min_new_tokens=3,
    )[0].tolist()  # fmt: skip
    rows, prompt_text = reference(hf_model, greedy), tokenizer.decode(prompt)
    logprobs = choice["logprobs"]
    assert choice["text"] == prompt_text + tokenizer.decode(greedy[len(prompt) :])
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in greedy]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [rows[j - 1, greedy[j]].item() for j in range(1, len(greedy))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=TOLERANCE)
    for j in range(1, len(greedy)):  # the token itself and the 2 best, by their text
        top_texts = {tokenizer.decode([t]) for t in rows[j - 1].topk(2).indices.tolist()}
        assert set(logprobs["top_logprobs"][j]) == top_texts | {tokenizer.decode([greedy[j]])}
    # Offsets count the text before each token; the first generated token's is the prompt's.
    lengths = [len(token) for token in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:j]) for j in range(len(greedy))]
    assert logprobs["text_offset"][len(prompt)] == len(prompt_text)


def test_echo_with_max_tokens_zero_returns_the_scored_prompt_only(
    server: InProcessServer, hf_model, tokenizer
) -> None:
    body = {"model": "tiny", "prompt": "Score me, please.", "echo": True, "max_tokens": 0}
    scored = complete(server, {**body, "logprobs": 0})
    [choice] = scored["choices"]
    prompt = tokenizer.encode("Score me, please.")
    assert choice["text"] == "Score me, please." and choice["finish_reason"] == "length"
    usage = scored["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 0)
    rows = reference(hf_model, prompt)
    expected = [None] + [rows[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=TOLERANCE)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in prompt]
    plain = complete(server, body)["choices"][0]
    assert plain["text"] == "Score me, please." and plain["logprobs"] is None
    [streamed] = [c for c in stream(server, {**body, "logprobs": 0}) if c["choices"]]
    assert streamed["choices"][0]["text"] == "Score me, please."
    assert streamed["choices"][0]["finish_reason"] == "length"
    assert_logprobs_close(streamed["choices"][0]["logprobs"], choice["logprobs"])


def test_streamed_echo_equals_the_whole_response(server: InProcessServer) -> None:
    body = {
        "model": "tiny", "prompt": "print('hi')", "echo": True, "logprobs": 1, "max_tokens": 6,
        "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    whole = complete(server, body)["choices"][0]
    chunks = [c["choices"][0] for c in stream(server, body) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    merged = {
        name: [value for c in chunks for value in c["logprobs"][name]]
        for name in ("tokens", "text_offset", "token_logprobs", "top_logprobs")
    }
    # A stream's offsets count the text it sent (vLLM's too): past the first generated token
    # they differ from the whole response's wherever a token's text is not shown as it is (a
    # skipped special token, a partial UTF-8 character).
    num_prompt = len("print('hi')")
    assert_logprobs_close(merged, whole["logprobs"], num_offsets=num_prompt + 1)
    assert chunks[0]["logprobs"]["text_offset"][num_prompt] == num_prompt


def test_prompt_logprobs_in_vllm_shape(server: InProcessServer, hf_model, tokenizer) -> None:
    body = {"model": "tiny", "prompt": "abc def", "prompt_logprobs": 2, "max_tokens": 1}
    [choice] = complete(server, body)["choices"]
    assert choice["logprobs"] is None
    prompt, rows = tokenizer.encode("abc def"), reference(hf_model, tokenizer.encode("abc def"))
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        top_ids = rows[j - 1].topk(2).indices.tolist()
        entries = prompt_logprobs[j]
        assert set(entries) == {str(t) for t in [prompt[j], *top_ids]}
        entry = entries[str(prompt[j])]
        assert entry["logprob"] == pytest.approx(rows[j - 1, prompt[j]].item(), abs=TOLERANCE)
        assert entry["rank"] == int((rows[j - 1] >= rows[j - 1, prompt[j]]).sum())
        assert entry["decoded_token"] == tokenizer.decode([prompt[j]])
        assert [entries[str(t)]["rank"] for t in top_ids] == [1, 2]


# ---- stream_options ----


def test_continuous_usage_stats_put_usage_on_every_chunk(server: InProcessServer) -> None:
    body = {"model": "tiny", "prompt": "count", "max_tokens": 5, "ignore_eos": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(server, {**body, "stream_options": options})
    assert all(c["usage"] is not None for c in chunks)
    completion_tokens = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 5
    # As in vLLM, continuous usage counts only together with include_usage.
    without = stream(server, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(c["usage"] is None for c in without)
