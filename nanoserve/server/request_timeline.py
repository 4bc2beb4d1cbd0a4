"""GET /v1/requests/{id}/timeline: what the engine did with a recent request, as JSON or as a
Chrome trace (`?format=chrome`, for chrome://tracing and Perfetto).

Which requests are recorded: every one under `--enable-request-timeline`; otherwise, while the
playground is on, those that ask with the header `X-Request-Timeline: true` (the page does).
The timelines themselves are built by `client/request_timeline.py`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from nanoserve.server.config import ServerConfig
from nanoserve.server.errors import APIError
from nanoserve.server.openai.served_model import ServedModel

TIMELINE_HEADER = "x-request-timeline"
FORMATS = ("json", "chrome")
SPAN_EVENTS = ("prefill", "decode", "recompute")


def wants_timeline(config: ServerConfig, headers: Headers) -> bool:
    """Whether this request's timeline is recorded."""
    if config.enable_request_timeline:
        return True
    return config.enable_playground and headers.get(TIMELINE_HEADER, "").lower() == "true"


def chrome_trace(timeline: dict[str, Any]) -> dict[str, Any]:
    """The Trace Event Format: one thread per engine request, steps as complete events ("X"),
    waiting as a span, preemptions and the end as instant events ("i"); times in µs."""
    process = {"name": f"nanoserve {timeline['id']}"}
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "args": process}]
    for tid, request in enumerate(timeline["requests"], start=1):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 1,
                "tid": tid,
                "args": {"name": request["request_id"]},
            }
        )
        events += _request_trace_events(request["events"], tid)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _request_trace_events(events: list[dict[str, Any]], tid: int) -> list[dict[str, Any]]:
    trace: list[dict[str, Any]] = []
    wait_start: float | None = None
    for event in events:
        kind = event["type"]
        if kind in ("queued", "preempted"):
            wait_start = event["t"]
        if kind == "admitted" and wait_start is not None:
            trace.append(_span("waiting", wait_start, event["t"], tid, event))
            wait_start = None
        if kind in SPAN_EVENTS:
            name = f"{kind} ×{event['num_steps']}" if event["num_steps"] > 1 else kind
            trace.append(_span(name, event["start"], event["end"], tid, event))
        elif kind != "queued":
            trace.append(
                {
                    "name": kind,
                    "ph": "i",
                    "s": "t",
                    "ts": _us(event["t"]),
                    "pid": 1,
                    "tid": tid,
                    "args": event,
                }
            )
    return trace


def _span(name: str, start: float, end: float, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "ts": _us(start),
        "dur": _us(end - start),
        "pid": 1,
        "tid": tid,
        "args": args,
    }


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def router(model: ServedModel) -> APIRouter:
    """GET /v1/requests/{request_id}/timeline."""
    api = APIRouter()

    @api.get("/v1/requests/{request_id}/timeline")
    async def request_timeline(request_id: str, format: str = "json") -> JSONResponse:
        if format not in FORMATS:
            raise APIError(f"format must be one of {', '.join(FORMATS)}, got {format!r}", 400)
        timelines = model.client.timelines
        if timelines is None:
            raise APIError(
                "request timelines are off: start the server with --enable-request-timeline "
                "(or without --disable-playground)",
                404,
            )
        timeline = timelines.as_json(request_id)
        if timeline is None:
            raise APIError(
                f"no timeline for request {request_id!r}: the last {timelines.max_requests} "
                "requests that recorded one are kept (every request with "
                "--enable-request-timeline; else those sent with 'X-Request-Timeline: true')",
                404,
            )
        return JSONResponse(chrome_trace(timeline) if format == "chrome" else timeline)

    return api
