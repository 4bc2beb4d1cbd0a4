"""Latency of non-streaming answers on a kept-alive connection, as the openai SDK sends them.

Against a running server (`nanoserve serve --model ~/.cache/nanoserve/bench-models/qwen3-0.6b`):
`GET /v1/models` a few times on one httpx connection, then non-streaming completions through the
official `openai` client of a document growing by one character (an editor's keystrokes, each
one token after a cached prefix). A server whose connections leave Nagle's algorithm on answers
each ~40 ms late (the body waits for the client's delayed ACK of the headers).

    python -m benchmarks.kept_alive_latency --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
import time
from pathlib import Path

import httpx
import openai


def timed_ms(call) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    with httpx.Client() as http:
        models = [timed_ms(lambda: http.get(f"{args.url}/v1/models")) for _ in range(args.requests)]
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    document = Path(textwrap.__file__).read_text(encoding="utf-8")

    def complete(num_chars: int) -> None:
        prompt = document[:num_chars]
        client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)

    complete(1500)  # the document, cached for the keystrokes
    keystrokes = [timed_ms(lambda k=k: complete(1501 + k)) for k in range(args.requests)]
    for name, times in (("GET /v1/models", models[1:]), ("keystroke completions", keystrokes)):
        print(
            f"{name}, kept-alive: median {statistics.median(times):.1f} ms "
            f"(min {min(times):.1f}, max {max(times):.1f})"
        )


if __name__ == "__main__":
    main()
