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

The express lane. With one message per request, aiohttp's request and
response objects, its router and five middleware layers were about half of
a leader's CPU per message (a cProfile of a leader under 32 clients). A
connection whose requests are plain produce requests skips them: while
aiohttp has not seen a byte of a connection, its bytes are framed here
(:func:`express_head`). A request the lane takes is exactly ``POST
/v1/topics/<name>/messages HTTP/1.1`` (a name of ``A-Z a-z 0-9 _ - .``, no
percent-encoding, no query but ``timeout_ms`` in bounds) whose header fields are each once of Host,
User-Agent, Accept-Encoding, Content-Type (``application/json``, or the
binary ``application/vnd.dledger.batch``), Accept
(``*/*`` or ``application/json``), ``Connection: keep-alive`` and a
Content-Length of at most 64 KiB (and the body cap): no Authorization,
Transfer-Encoding, Content-Encoding or Expect, no field it does not know,
every field name a token and every value visible ASCII. Its body is
checked against the same schema, proposed by the same code and answered
with the same bodies and errors
(:meth:`http_api.app.BrokerApi.produce_express`); the request metrics count
it on the same route. The first request that is anything else, and every
byte after it, goes to aiohttp (the connection stays there: requests are
answered in order, and aiohttp's parser never starts in the middle of a
stream it did not frame). A head still incomplete waits under the header
timeout, a body under the body timeout; bytes that arrive while a request is
in flight wait for its answer (pipelining keeps its order). The lane is on
unless ``http_express = false``, bearer-token auth is configured, or a
composition added a middleware to the node's app
(:func:`http_api.server.express_of`).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import orjson
from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from broker_adapter.codec import BATCH_CONTENT_TYPE
from http_api.guard import HttpLimits, body_timeout

logger = logging.getLogger(__name__)

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


# -- the express lane (module docstring) ---------------------------------------
EXPRESS_MAX_BODY = 64 << 10
EXPRESS_MAX_HEAD = 8 << 10
NEED_MORE: Final = "need more"
_PREFIX = b"POST /v1/topics/"
_SUFFIX = b" HTTP/1.1"
_ROUTE_END = b"/messages"
_TIMEOUT_Q = re.compile(rb"timeout_ms=([1-9][0-9]{0,5})")
TIMEOUT_MS_MAX = 600_000  # the produce route's timeout_ms (/openapi.json)
_TOPIC = re.compile(rb"[A-Za-z0-9_.\-]{1,127}")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z\-]+")
_VALUE = re.compile(rb"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*")


def _any(value: bytes) -> bool:
    return True


def _length(value: bytes) -> bool:
    return value.isdigit() and len(value) <= 9


_BATCH_TYPE = BATCH_CONTENT_TYPE.encode("ascii")
_CONTENT_TYPES = (b"application/json", b"application/json; charset=utf-8", _BATCH_TYPE)

# field name -> test of its lower-cased value; any other field: aiohttp answers
_FIELDS: dict[bytes, Callable[[bytes], bool]] = {
    b"host": _any,
    b"user-agent": _any,
    b"accept-encoding": _any,  # the answers are never encoded
    b"content-length": _length,
    b"content-type": lambda v: v in _CONTENT_TYPES,
    b"accept": lambda v: v in (b"*/*", b"application/json"),
    b"connection": lambda v: v == b"keep-alive",
}

# (topic, timeout_ms or None, offset of the body, body length, binary body),
# NEED_MORE, or None (aiohttp's)
Framed = tuple[str, int | None, int, int, bool] | str | None


def express_head(buf: bytes | bytearray, max_body: int = EXPRESS_MAX_BODY) -> Framed:
    """Whether the request at the start of ``buf`` is one the express lane
    takes (module docstring): its topic, where its body starts and its
    length; NEED_MORE while its head is incomplete and may still be one;
    None when aiohttp must answer it."""
    if len(buf) < len(_PREFIX):
        return NEED_MORE if _PREFIX.startswith(buf) else None
    if not buf.startswith(_PREFIX):
        return None
    end = buf.find(b"\r\n\r\n", 0, EXPRESS_MAX_HEAD)
    if end < 0:
        return NEED_MORE if len(buf) < EXPRESS_MAX_HEAD else None
    head = bytes(buf[:end])
    known = _heads.get(head)  # a client repeats its head: one parse per distinct head
    if known is None:
        known = _parse_head(head)
        if known is not None and len(head) <= _HEAD_CACHED_MAX:
            if len(_heads) >= _HEADS_MAX:
                _heads.clear()
            _heads[head] = known
    if known is None or known[2] > max_body:
        return None
    return known[0], known[1], end + 4, known[2], known[3]


_HEADS_MAX = 1024  # heads the lane took, at most 512 bytes each
_HEAD_CACHED_MAX = 512
_heads: dict[bytes, tuple[str, int | None, int, bool]] = {}


def _parse_head(head: bytes) -> tuple[str, int | None, int, bool] | None:
    """(topic, timeout_ms or None, body length, binary body) of a head the
    lane takes, else None."""
    lines = head.split(b"\r\n")
    line = lines[0]
    if not line.endswith(_SUFFIX):
        return None
    path, question, query = line[len(_PREFIX) : -len(_SUFFIX)].partition(b"?")
    if not path.endswith(_ROUTE_END):
        return None
    topic = path[: -len(_ROUTE_END)]
    if not _TOPIC.fullmatch(topic) or topic in (b".", b".."):
        return None
    timeout_ms = None
    if question:  # the route's one parameter, as digits within its bounds
        m = _TIMEOUT_Q.fullmatch(query)
        if m is None or int(m.group(1)) > TIMEOUT_MS_MAX:
            return None
        timeout_ms = int(m.group(1))
    length = -1
    binary = False
    seen: set[bytes] = set()
    for field in lines[1:]:
        name, colon, value = field.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            return None
        key = name.lower()
        test = _FIELDS.get(key)
        value = value.strip(b" \t")
        if test is None or key in seen or not _VALUE.fullmatch(value) or not test(value.lower()):
            return None
        seen.add(key)
        if key == b"content-length":
            length = int(value)
        elif key == b"content-type":
            binary = value.lower() == _BATCH_TYPE
    if not 0 <= length <= EXPRESS_MAX_BODY:
        return None
    return topic.decode("ascii"), timeout_ms, length, binary


_OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: "
_date_cache: list[Any] = [0, b""]


def _http_date() -> bytes:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[:] = [now, email.utils.formatdate(now, usegmt=True).encode()]
    return bytes(_date_cache[1])


def answer_bytes(answer: bytes | web.Response) -> tuple[bytes, bool]:
    """The express lane's answer on the wire, and whether it closes the
    connection: a success body as a 200, an error response as it is."""
    date = _http_date()
    if isinstance(answer, bytes):
        head = b"%s%s\r\nContent-Length: %d\r\n\r\n" % (_OK_HEAD, date, len(answer))
        return head + answer, False
    body = answer.body
    assert isinstance(body, bytes)
    close = answer.keep_alive is False
    lines = [f"HTTP/1.1 {answer.status} {answer.reason}"]
    for name, value in answer.headers.items():
        if name.lower() not in ("content-length", "connection", "date"):
            lines.append(f"{name}: {value}")
    lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\nDate: ").encode("latin-1") + date + b"\r\n\r\n"
    return head + body, close


# what answers an express request: (topic, body, request target, timeout_ms,
# binary body)
Express = Callable[[str, bytes, str, int | None, bool], Awaitable[bytes | web.Response]]
# above this many bytes waiting behind an express request, reading pauses
_XBUF_PAUSE = 1 << 20


class NodeRequestHandler(RequestHandler):
    """aiohttp's connection handler with the node's limits (module docstring)."""

    limits: HttpLimits = HttpLimits()
    express: Express | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._got_bytes = False
        # the express lane: on until aiohttp sees a byte of this connection
        self._x_on = self.express is not None
        self._xbuf = bytearray()
        self._x_busy = False
        self._x_paused = False
        self._x_idle: asyncio.TimerHandle | None = None  # the idle timeout
        self._x_body: asyncio.TimerHandle | None = None  # the body timeout
        self._x_task: asyncio.Task[None] | None = None  # the answer in flight
        self._x_answered = 0.0  # loop time of the last answer (the idle timeout)

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
        self._cancel_lane_timers()
        self._xbuf = bytearray()
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
        if self._x_on:
            if self._force_close or self._close:
                return
            if self._keepalive_handle is not None:
                # aiohttp's timer for a connection that never sent it a
                # request: the lane's own timeouts govern from here on
                self._keepalive_handle.cancel()
                self._keepalive_handle = None
            self._xbuf += data
            if self._x_busy:
                if len(self._xbuf) > _XBUF_PAUSE and not self._x_paused and self.transport:
                    self._x_paused = True
                    self.transport.pause_reading()
            else:
                self._express_next()
            return
        self._aiohttp_received(data)

    # -- the express lane ------------------------------------------------------------
    def _cancel_lane_timers(self) -> None:
        for timer in (self._x_idle, self._x_body):
            if timer is not None:
                timer.cancel()
        self._x_idle = self._x_body = None

    def _express_next(self) -> None:
        """Take the next request from the buffer: answer it here, wait for
        more of it, or hand the buffer (and the connection) to aiohttp."""
        if not self._xbuf or self._force_close:
            return
        framed = express_head(self._xbuf, self.limits.max_body_bytes)
        if framed is None:
            self._x_on = False
            self._cancel_lane_timers()
            data, self._xbuf = bytes(self._xbuf), bytearray()
            self._aiohttp_received(data)
            return
        if isinstance(framed, str):  # NEED_MORE: a head on its way, under the header timeout
            if self._header_timer is None:
                self._arm_header_timer()
            self._got_bytes = True
            return
        self._cancel_header_timer()
        self._got_bytes = False
        topic, timeout_ms, start, length, binary = framed
        if len(self._xbuf) < start + length:  # a body on its way, under the body timeout
            if self._x_body is None:
                self._x_body = self._loop.call_later(
                    self.limits.body_timeout_s, self._body_timed_out
                )
            return
        if self._x_body is not None:
            self._x_body.cancel()
            self._x_body = None
        body = bytes(self._xbuf[start : start + length])
        target = self._xbuf[5 : self._xbuf.index(b" ", 5)].decode("ascii")
        del self._xbuf[: start + length]
        self._x_busy = True
        self._request_in_progress = True  # a shutdown waits for the answer
        self._x_task = self._loop.create_task(
            self._express_answer(topic, body, target, timeout_ms, binary)
        )

    async def _express_answer(
        self, topic: str, body: bytes, target: str, timeout_ms: int | None, binary: bool
    ) -> None:
        express = self.express
        assert express is not None
        close = True
        try:
            wire, close = answer_bytes(await express(topic, body, target, timeout_ms, binary))
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(wire)
        except Exception:  # produce_express answers its errors; this is a bug
            logger.exception("the express lane failed; closing the connection")
        finally:
            self._x_busy = False
            self._x_task = None
            self._request_in_progress = False
            if self._handler_waiter is not None and not self._handler_waiter.done():
                self._handler_waiter.set_result(None)  # a shutdown was waiting
            if close or self._force_close or self._close:
                self.force_close()
            else:
                if self._x_paused and self.transport is not None:
                    self._x_paused = False
                    self.transport.resume_reading()
                self._x_answered = self._loop.time()
                if self._xbuf:
                    self._express_next()
                elif self._x_idle is None:
                    self._x_idle = self._loop.call_at(
                        self._x_answered + self.limits.idle_timeout_s, self._idle_timed_out
                    )

    def _body_timed_out(self) -> None:
        self._x_body = None
        exc = body_timeout(self.limits)
        self._refuse(408, exc.code, str(exc))

    def _idle_timed_out(self) -> None:
        self._x_idle = None
        if self._x_busy or self._xbuf or not self._x_on:
            return  # a request is here (or aiohttp has the connection): its own timers apply
        due = self._x_answered + self.limits.idle_timeout_s
        if self._loop.time() >= due:
            self.force_close()
        else:  # answered again since this timer was armed
            self._x_idle = self._loop.call_at(due, self._idle_timed_out)

    # -- aiohttp's path --------------------------------------------------------------
    def _aiohttp_received(self, data: bytes) -> None:
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

    def __init__(
        self, *args: Any, limits: HttpLimits, express: Express | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.handler_class = type(
            "BoundHandler",
            (NodeRequestHandler,),
            {"limits": limits, "express": staticmethod(express) if express else None},
        )

    def __call__(self) -> RequestHandler:
        return self.handler_class(self, loop=self._loop, **self._kwargs)  # type: ignore[no-any-return]


class NodeAppRunner(web.AppRunner):
    """An AppRunner whose connections keep the node's HTTP limits."""

    def __init__(
        self,
        app: web.Application,
        limits: HttpLimits,
        express: Express | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("keepalive_timeout", limits.idle_timeout_s)
        kwargs.setdefault("auto_decompress", False)
        # after answering a request whose body it did not read (a 408, 413,
        # 401...), aiohttp reads and drops the rest for this long (10 s by
        # default) before closing
        kwargs.setdefault("lingering_time", min(LINGER_S, limits.body_timeout_s))
        super().__init__(app, **kwargs)
        self.limits = limits
        self.express = express

    async def _make_server(self) -> Server:
        made = await super()._make_server()
        return LimitedServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            limits=self.limits,
            express=self.express,
            **made._kwargs,
        )
