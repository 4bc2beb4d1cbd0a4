"""The measuring client on canned SSE streams: timings of a good stream, errors of broken ones."""

from __future__ import annotations

import asyncio
import builtins
import importlib
import json

import httpx
import pytest

from nanoserve.bench.client import RequestResult, completion_body, stream_completion
from nanoserve.bench.metrics import summarize


def _frame(choices: list, usage: dict | None = None) -> str:
    body = {"id": "x", "object": "text_completion", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def _text(text: str, finish: str | None = None) -> dict:
    return {"index": 0, "text": text, "finish_reason": finish}


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
GOOD_STREAM = (
    _frame([_text("a")])
    + ": keep-alive\n\n"
    + _frame([_text("b")])
    + _frame([_text("c", "length")])
    + _frame([], USAGE)
    + "data: [DONE]\n\n"
)


def _run(body: str, status: int = 200) -> RequestResult:
    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream_options"] == {"include_usage": True}
        return httpx.Response(status, text=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        result = RequestResult(index=0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            request = completion_body("m", "hello", 3)
            await stream_completion(client, "http://test/v1/completions", request, result, 0.0)
        return result

    return asyncio.run(go())


def test_the_request_body_is_greedy_unless_given_a_temperature():
    assert completion_body("m", "hello", 3)["temperature"] == 0.0
    assert completion_body("m", "hello", 3, temperature=1.0)["temperature"] == 1.0


def test_client_measures_a_good_stream():
    result = _run(GOOD_STREAM)
    assert result.error is None and result.is_ok
    assert result.text == "abc"
    assert (result.prompt_tokens, result.output_tokens) == (5, 3)
    assert result.finish_reason == "length"
    assert len(result.itl_s) == 2  # three text chunks, two gaps
    assert 0 <= result.ttft_s <= result.e2e_s
    assert result.tpot_s == pytest.approx((result.e2e_s - result.ttft_s) / 2)
    summary = summarize([result], duration_s=1.0)
    assert summary["num_completed"] == 1 and summary["num_errors"] == 0
    assert summary["output_throughput"] == 3.0


@pytest.mark.parametrize(
    ("body", "status", "error_start"),
    [
        ("boom", 500, "HTTP 500"),
        (_frame([_text("a")]) + 'data: {"error": {"message": "bad"}}\n\n', 200, "error frame"),
        (_frame([_text("a")]) + "event: error\ndata: {}\n\n", 200, "error frame"),
        (_frame([_text("a")]) + "data: {not json\n\n", 200, "frame is not JSON"),
        (_frame([_text("a")]) + _frame([], USAGE), 200, "stream ended without"),
        (_frame([_text("a")]) + "data: [DONE]\n\n", 200, "no usage"),
        (_frame([], USAGE) + "data: [DONE]\n\n", 200, "no chunk with choices"),
    ],
)
def test_client_counts_broken_streams_as_errors(body, status, error_start):
    result = _run(body, status)
    assert result.error is not None and result.error.startswith(error_start), result.error
    assert not result.is_ok
    assert summarize([result], duration_s=1.0)["num_errors"] == 1


def test_a_dropped_request_counts_its_first_token_but_not_as_finished():
    """Autocomplete drops most requests after their first token: the time to it is counted
    among the answered, not the finished; one dropped before a token, and errors, are not."""
    finished = RequestResult(index=0, ttft_s=0.1, e2e_s=0.5, output_tokens=3)
    dropped_after_token = RequestResult(index=1, ttft_s=0.3, dropped=True)
    dropped_before_token = RequestResult(index=2, dropped=True)
    failed = RequestResult(index=3, ttft_s=0.9, error="HTTP 500")
    results = [finished, dropped_after_token, dropped_before_token, failed]
    summary = summarize(results, duration_s=1.0)
    assert summary["num_completed"] == 1 and summary["num_dropped"] == 2
    assert summary["num_answered"] == 2
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["ttft_answered_ms"]["p50"] == pytest.approx(200.0)  # 100 and 300 ms


def test_a_task_an_interrupt_ended_is_not_logged_but_any_other_failure_is(caplog):
    """An interrupt can land inside httpx's connection code, whose task groups wrap it; the
    measuring loops' handler keeps its traceback out of the bench's one-line exit."""
    from nanoserve.bench.client import is_interrupt, quiet_about_interrupts

    # Python 3.11's built-in, or on 3.10 the backport anyio (under httpx) depends on
    group = getattr(builtins, "BaseExceptionGroup", None)
    group = group or importlib.import_module("exceptiongroup").BaseExceptionGroup
    wrapped = group("connect", [KeyboardInterrupt(), asyncio.CancelledError()])
    assert is_interrupt(KeyboardInterrupt()) and is_interrupt(wrapped)
    assert not is_interrupt(group("mixed", [KeyboardInterrupt(), ValueError()]))
    assert not is_interrupt(ValueError()) and not is_interrupt(None)

    async def fail(exception: BaseException) -> None:
        raise exception

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_about_interrupts)
        for exception in (wrapped, ValueError("a real failure")):
            task = asyncio.create_task(fail(exception))
            await asyncio.wait([task])
            loop.call_exception_handler({"message": "never retrieved", "exception": exception})
            task.exception()  # retrieved: nothing else logs it

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
    logged = [record.getMessage() for record in caplog.records if record.name == "asyncio"]
    assert logged == ["never retrieved"]  # the ValueError's, not the interrupt's
    assert "a real failure" in caplog.text and "KeyboardInterrupt" not in caplog.text
