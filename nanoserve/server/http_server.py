"""uvicorn, with the deadlines it lacks and a shutdown that ends every stream properly.

uvicorn times out idle keep-alive connections only. Here, per connection (h11):

- **header timeout**: a connection must deliver a request's line and headers within
  `--header-timeout` seconds of opening (or of its last response); else it is closed. The same
  deadline closes a connection still sending the body of a request that was already answered.
- **framing** (`FramedH11Connection`): a request's line and headers may take 16 KiB however
  they arrive (h11 itself bounds only headers still incomplete, which one write is not), and a
  request with both Transfer-Encoding and Content-Length is refused (RFC 9112 §6.3: its body's
  length is ambiguous, the way requests are smuggled past proxies). Either is a 400, and the
  connection is closed.
- **send timeout**: when the connection's send buffer stays full (the kernel's socket buffer
  and asyncio's 64 KiB above it) and the client reads nothing of it for `--send-timeout`
  seconds, the connection is aborted (a client that reads, however slowly, gets another
  period). The request handler sees a disconnect: its engine requests are
  aborted, their KV blocks freed, and `vllm:http_requests_client_disconnected_total` counts it.
- the **body timeout** (`--body-timeout`) is kept by `request_body.read_json_body`: a 408.

On SIGINT/SIGTERM uvicorn stops accepting connections and waits for in-flight requests. Before
that wait ends, `on_shutdown(grace_s)` has the engine client end every unfinished stream with an
error frame and `data: [DONE]` at `grace_s` (`--shutdown-timeout`); uvicorn's own deadline comes
`SHUTDOWN_FLUSH_S` later, so those last frames are written before it would cut connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("nanoserve.server")

SHUTDOWN_FLUSH_S = 2.0  # after the grace period: time to write the streams' last frames


class FramedH11Connection(h11.Connection):
    """h11's server side, refusing what h11 lets through: headers over `max_header_bytes` that
    arrived whole, and a request framed by both Transfer-Encoding and Content-Length."""

    def __init__(self, max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            self._check_framing(event)
        return event

    def _check_framing(self, request: h11.Request) -> None:
        """uvicorn answers this error with a 400 and closes the connection."""
        fields = request.headers.raw_items()
        num_bytes = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n\r\n")
        num_bytes += sum(len(name) + len(value) + len(b": \r\n") for name, value in fields)
        if num_bytes > self.max_header_bytes:
            raise h11.RemoteProtocolError(
                f"request line and headers of {num_bytes} bytes; at most "
                f"{self.max_header_bytes} are read",
                error_status_hint=431,
            )
        names = {name.lower() for name, _ in fields}
        if b"transfer-encoding" in names and b"content-length" in names:
            raise h11.RemoteProtocolError(
                "a request with both Transfer-Encoding and Content-Length (RFC 9112 §6.3)"
            )


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 connection with a header deadline, a send timeout and framing checks."""

    header_timeout_s = 30.0
    send_timeout_s = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        max_header_bytes = self.config.h11_max_incomplete_event_size
        self.conn = FramedH11Connection(max_header_bytes or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self._header_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._buffered_bytes = 0  # in the send buffer when the send timer was armed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _on_header_timeout(self) -> None:
        waiting_for_headers = self.conn.their_state is h11.IDLE
        unread_body = self.conn.their_state is h11.SEND_BODY and (
            self.cycle is None or self.cycle.response_complete
        )
        if (waiting_for_headers or unread_body) and not self.transport.is_closing():
            logger.info(
                "closing a connection from %s: no complete request within %g s (--header-timeout)",
                self.client,
                self.header_timeout_s,
            )
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._arm_send_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _arm_send_timer(self) -> None:
        # While writing is paused nothing is added to the buffer: if it shrank, the client read.
        self._buffered_bytes = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.send_timeout_s, self._on_send_timeout)

    def _on_send_timeout(self) -> None:
        self._send_timer = None
        if not self.flow.write_paused or self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size() < self._buffered_bytes:
            self._arm_send_timer()  # slow, but reading: another period
        else:
            logger.warning(
                "aborting a connection from %s: it read nothing for %g s with its send buffer "
                "full (--send-timeout)",
                self.client,
                self.send_timeout_s,
            )
            self.transport.abort()  # close() would wait for the buffer to drain, forever


def timed_h11_protocol(header_timeout_s: float, send_timeout_s: float) -> type[TimedH11Protocol]:
    """The protocol class uvicorn builds connections from, with these deadlines."""
    return type(
        "TimedH11Protocol",
        (TimedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "send_timeout_s": send_timeout_s},
    )


class GracefulServer(uvicorn.Server):
    """uvicorn's server that calls `on_shutdown()` as soon as its shutdown begins, and runs the
    app's lifespan shutdown (which stops the engine) even after a second Ctrl-C."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skipped it: it would be cancelled midway, a traceback
            await self.lifespan.shutdown()
