"""The transformers baseline: a small FastAPI server over `model.generate`, as bake-offs use.

    python -m nanoserve.bench.hf_server --model DIR --port 8001 [--threads N] [--dtype auto]

Serves `/v1/completions` (streamed with SSE, usage chunk on `stream_options.include_usage`),
`/v1/models` and `/health`. Like the baselines public comparisons run, it handles one request
at a time: each request holds a lock for its whole generation, so concurrent requests queue
(no batching). Generation is eager PyTorch (no torch.compile), one `generate` call per request
with a KV cache. Text streams through a `TextIteratorStreamer` that yields after every token
(the stock one holds symbols back until the next space, which would delay the first chunk).
A dropped connection stops its generation at the next token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)


class PerTokenStreamer(TextIteratorStreamer):
    """Queues the new text after every generated token; counts the tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> None:
        super().__init__(tokenizer, skip_prompt=True, **kwargs)
        self.num_tokens = 0
        self.error: str | None = None

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:
            value = value[0]
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.num_tokens += value.numel()
        self.token_cache.extend(value.tolist())
        # decode returns list[str] only for a batch of id lists; token_cache is one list of ids.
        text = cast(str, self.tokenizer.decode(self.token_cache, **self.decode_kwargs))
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 character: wait for its next byte
        new_text = text[self.print_len :]
        self.print_len = len(text)
        if new_text:
            self.on_finalized_text(new_text)


class StopWhenSet(StoppingCriteria):
    """Stops generation once the client has gone away."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class BadRequest(ValueError):
    """A request the baseline cannot serve; answered with HTTP 400."""


def parse_request(body: dict) -> dict:
    """Validate the few fields the baseline supports."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string (a list of one string is accepted)")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be an integer ≥ 1, got {max_tokens!r}")
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise BadRequest(f"temperature must be ≥ 0, got {temperature!r}")
    top_p = body.get("top_p", 1.0)
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p!r}")
    if body.get("n", 1) != 1:
        raise BadRequest("the baseline serves n = 1 only")
    if body.get("stop"):
        raise BadRequest("the baseline does not support stop strings")
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": float(temperature),
        "top_p": float(top_p),
        "seed": body.get("seed"),
        "ignore_eos": bool(body.get("ignore_eos", False)),
        "stream": bool(body.get("stream", False)),
        "include_usage": bool((body.get("stream_options") or {}).get("include_usage", False)),
    }


class HFGenerator:
    """A transformers model that serves one request at a time, streaming token by token."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
        self.lock = asyncio.Lock()  # one generation at a time

    def _generate(self, request: dict, streamer: PerTokenStreamer, cancel: threading.Event) -> None:
        """`model.generate` for one request (in its own thread), text into `streamer`."""
        inputs = self.tokenizer(request["prompt"], return_tensors="pt", add_special_tokens=False)
        kwargs = {"max_new_tokens": request["max_tokens"]}
        if request["temperature"] > 0:
            kwargs.update(
                do_sample=True, temperature=request["temperature"], top_p=request["top_p"]
            )
            if request["seed"] is not None:
                torch.manual_seed(request["seed"])
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if request["ignore_eos"]:
            kwargs["eos_token_id"] = None
        try:
            with torch.inference_mode():
                self.model.generate(
                    **inputs,
                    **kwargs,
                    pad_token_id=self.tokenizer.pad_token_id,
                    streamer=streamer,
                    stopping_criteria=StoppingCriteriaList([StopWhenSet(cancel)]),
                )
        except Exception as exc:  # reported to the client as an error frame
            streamer.error = f"{type(exc).__name__}: {exc}"
            streamer.end()
            raise

    async def run(self, request: dict) -> AsyncIterator[tuple[str | None, dict | None]]:
        """Yield (text, None) per chunk, then (None, summary) once generation ends."""
        async with self.lock:
            cancel = threading.Event()
            streamer = PerTokenStreamer(self.tokenizer)
            prompt_ids = self.tokenizer.encode(request["prompt"], add_special_tokens=False)
            thread = threading.Thread(target=self._generate, args=(request, streamer, cancel))
            thread.start()
            loop = asyncio.get_running_loop()
            try:
                while True:
                    text = await loop.run_in_executor(None, streamer.text_queue.get)
                    if text is streamer.stop_signal:
                        break
                    if text:
                        yield text, None
            finally:
                cancel.set()
                await loop.run_in_executor(None, thread.join)
            num_tokens = streamer.num_tokens
            summary = {
                "finish_reason": "length" if num_tokens >= request["max_tokens"] else "stop",
                "error": streamer.error,
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": num_tokens,
                    "total_tokens": len(prompt_ids) + num_tokens,
                },
            }
            yield None, summary


def _frame(head: dict, choices: list, usage: dict | None = None) -> str:
    """One SSE event: the completion's id, object, created and model, then choices (and usage)."""
    frame = {**head, "choices": choices}
    if usage is not None:
        frame["usage"] = usage
    return f"data: {json.dumps(frame)}\n\n"


async def _complete(generator: HFGenerator, request: dict, head: dict) -> dict | JSONResponse:
    """The whole completion as one JSON body (stream false)."""
    text, summary = "", None
    async for piece, summary in generator.run(request):  # noqa: B007 (the last one is kept)
        text += piece or ""
    assert summary is not None  # run() always ends with the summary
    if summary["error"]:
        return JSONResponse({"error": {"message": summary["error"]}}, status_code=500)
    choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = summary["finish_reason"]
    return {**head, "choices": [choice], "usage": summary["usage"]}


async def _events(generator: HFGenerator, request: dict, head: dict) -> AsyncIterator[str]:
    """SSE events: a chunk per piece of text, the finish reason, usage if asked, [DONE]."""
    async for piece, summary in generator.run(request):
        if piece is not None:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
            yield _frame(head, [choice])
            continue
        assert summary is not None  # a piece of None comes with the summary
        if summary["error"]:
            yield f"data: {json.dumps({'error': {'message': summary['error']}})}\n\n"
        else:
            finish = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": summary["finish_reason"],
            }
            yield _frame(head, [finish])
            if request["include_usage"]:
                yield _frame(head, [], summary["usage"])
    yield "data: [DONE]\n\n"


def create_app(model_dir: str, served_name: str, dtype: str) -> FastAPI:
    """The baseline's FastAPI app: /health, /v1/models and /v1/completions."""
    generator = HFGenerator(model_dir, dtype)
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": served_name, "object": "model", "owned_by": "transformers"}],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(http_request: Request) -> dict | Response:
        try:
            request = parse_request(await http_request.json())
        except (BadRequest, ValueError) as exc:
            error = {"message": str(exc), "type": "invalid_request_error", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served_name,
        }
        if not request["stream"]:
            return await _complete(generator, request, head)
        return StreamingResponse(_events(generator, request, head), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    """Serve the baseline until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--served-model-name", default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    app = create_app(args.model, args.served_model_name or args.model, args.dtype)
    print(
        f"hf baseline: {args.model}, {torch.get_num_threads()} threads, dtype {args.dtype}, "
        "eager, one request at a time",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
