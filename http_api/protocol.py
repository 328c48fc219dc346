"""The node's HTTP connections: aiohttp's protocol with the node's limits.

* Every answer aiohttp itself makes (an HTTP message its parser refuses:
  bad or repeated Content-Length, Content-Length with Transfer-Encoding,
  bare LF, NUL, an over-long request line or header, too many headers, an
  unknown method, an HTTP/2 preface, a TLS hello; a handler's unhandled
  error) is the error envelope ``{"error": {"code", "message"}}``, and never
  echoes the request's bytes.
* A connection must complete a request header within the header timeout
  of opening (or of the first byte after its previous answer): else it is
  answered 408 (when it sent something) and closed. An idle keep-alive
  connection is closed after the idle timeout. The body timeout is applied
  where the body is read (:mod:`http_api.guard`); after an answer to a
  request whose body was not (all) read, the rest is read and dropped for
  at most :data:`LINGER_S` seconds, then the connection is closed.
* Above ``max_connections`` open connections a new one is answered 503 in
  the envelope and closed.
* Bodies are not inflated by aiohttp (``auto_decompress=False``): the guard
  inflates them in steps, under the body cap.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from http_api.guard import HttpLimits

LINGER_S = 2.0

_REASONS = {400: "Bad Request", 408: "Request Timeout", 500: "Internal Server Error",
            503: "Service Unavailable", 504: "Gateway Timeout"}  # fmt: skip

# (exception class, code, message): first match wins; no request bytes shown.
_PARSER_ERRORS: tuple[tuple[type[BaseException], str, str], ...] = (
    (http_exceptions.LineTooLong, "LINE_TOO_LONG", "a request line or header is too long"),
    (http_exceptions.BadHttpMethod, "BAD_METHOD", "not an HTTP/1.x request or unknown method"),
    (http_exceptions.BadStatusLine, "BAD_REQUEST_LINE", "malformed request line"),
    (http_exceptions.InvalidURLError, "BAD_URL", "malformed request target"),
    (http_exceptions.InvalidHeader, "BAD_HEADER", "malformed or repeated header"),
    (http_exceptions.ContentLengthError, "BAD_CONTENT_LENGTH", "body and Content-Length differ"),
    (http_exceptions.TransferEncodingError, "BAD_TRANSFER_ENCODING", "malformed chunked body"),
    (http_exceptions.ContentEncodingError, "BAD_CONTENT_ENCODING", "body does not decode"),
    (http_exceptions.BadHttpMessage, "BAD_HTTP_MESSAGE", "malformed HTTP message"),
    (http_exceptions.HttpProcessingError, "BAD_HTTP_MESSAGE", "malformed HTTP message"),
)


def envelope_bytes(status: int, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer with the envelope, that closes the connection."""
    body = orjson.dumps({"error": {"code": code, "message": message}})
    retry = b"Retry-After: 1\r\n" if status == 503 else b""
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + retry
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


def parser_error(exc: BaseException | None) -> tuple[str, str]:
    for cls, code, message in _PARSER_ERRORS:
        if isinstance(exc, cls):
            return code, f"{message} ({cls.__name__})"
    return "BAD_HTTP_MESSAGE", "malformed HTTP message"


class NodeRequestHandler(RequestHandler):
    """aiohttp's connection handler with the node's limits (module docstring)."""

    limits: HttpLimits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._got_bytes = False

    # -- open connections ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        manager = self._manager
        if manager is not None and len(manager.connections) > self.limits.max_connections:
            self._refuse(
                503,
                "TOO_MANY_CONNECTIONS",
                f"this node holds {self.limits.max_connections} connections "
                "(http_max_connections); retry later",
            )
            return
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _refuse(self, status: int, code: str, message: str) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(envelope_bytes(status, code, message))
        self.force_close()

    # -- header timeout -----------------------------------------------------------
    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self._force_close:
            self._header_timer = self._loop.call_later(
                self.limits.header_timeout_s, self._header_timed_out
            )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self._request_in_progress or self._messages or self._force_close:
            return  # a request header arrived in time
        if self._got_bytes:
            self._refuse(
                408,
                "REQUEST_HEADER_TIMEOUT",
                f"no complete request header within {self.limits.header_timeout_s * 1000:.0f} "
                "ms (http_header_timeout_ms)",
            )
        else:
            self.force_close()

    def data_received(self, data: bytes) -> None:
        if data and not self._request_in_progress and not self._messages:
            if self._header_timer is None:  # the first byte of a new request
                self._arm_header_timer()
            self._got_bytes = True
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:
            self._cancel_header_timer()
            self._got_bytes = False

    # -- answers aiohttp makes itself -----------------------------------------------
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already sent; closing")
        if status == 500:
            self.log_exception("unhandled error serving %s", request.remote, exc_info=exc)
            code, text = "INTERNAL", "internal error (a bug: see the node's log)"
        elif status == 504:
            code, text = "TIMEOUT", "the handler timed out"
        else:
            self.log_debug("refused a malformed request from %s", request.remote, exc_info=exc)
            code, text = parser_error(exc)
        body = orjson.dumps({"error": {"code": code, "message": text}})
        resp = web.Response(status=status, body=body, content_type="application/json")
        resp.force_close()
        return resp


class LimitedServer(Server):
    """aiohttp's low-level server making :class:`NodeRequestHandler`s."""

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handler_class = type("BoundHandler", (NodeRequestHandler,), {"limits": limits})

    def __call__(self) -> RequestHandler:
        return self.handler_class(self, loop=self._loop, **self._kwargs)  # type: ignore[no-any-return]


class NodeAppRunner(web.AppRunner):
    """An AppRunner whose connections keep the node's HTTP limits."""

    def __init__(self, app: web.Application, limits: HttpLimits, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", limits.idle_timeout_s)
        kwargs.setdefault("auto_decompress", False)
        # after answering a request whose body it did not read (a 408, 413,
        # 401...), aiohttp reads and drops the rest for this long (10 s by
        # default) before closing
        kwargs.setdefault("lingering_time", min(LINGER_S, limits.body_timeout_s))
        super().__init__(app, **kwargs)
        self.limits = limits

    async def _make_server(self) -> Server:
        made = await super()._make_server()
        return LimitedServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            limits=self.limits,
            **made._kwargs,
        )
