"""What every request must pass before a handler sees it, with the node's
HTTP caps (``[node]`` of the cluster file, :class:`dledger.config.NodeConfig`).

The HTTP server shares its event loop with Raft: ticks, heartbeats and peer
messages wait while a handler runs. So no request may carry more work than
a loop pass can afford, and work that grows with the request is done in
steps with yields to the loop in between:

* :func:`edge` (outermost after the metrics middleware): a repeated
  ``Authorization`` header is a 400; a ``Content-Length`` above the body
  cap is a 413 before any byte of the body is read; a ``Content-Encoding``
  other than ``gzip``/``x-gzip``/``deflate``/``identity`` (one of them) is a
  415.
* :func:`strict` (after authentication): the query and path values are
  checked against the operation's parameters in /openapi.json (unknown or
  repeated parameters, non-ASCII or signed digits, out-of-bounds values,
  unknown enum values: 422 naming the parameter); the body is read within
  the body timeout (408), inflated in steps of :data:`INFLATE_STEP` bytes
  with a yield between steps and refused (413) as soon as it passes the cap
  (a body that does not inflate is a 400), parsed (a body that is not JSON
  is a 400) and checked against the operation's request schema (422 naming
  the field; big arrays in slices, :func:`http_api.schema.check_body`).

The checked body is left in ``request[JSON_BODY]`` and the raw (inflated)
bytes are what ``request.read()`` answers afterwards. Every refusal is the
error envelope.
"""

from __future__ import annotations

import asyncio
import gc
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import hdrs, web

from broker_adapter import codec
from broker_adapter.errors import BrokerError, InvalidArgument
from dledger.config import NodeConfig
from dledger.errors import DLedgerError
from http_api.errors import (
    BadBody,
    BadEncoding,
    BodyTimeout,
    PayloadTooLarge,
    UnsupportedEncoding,
    UnsupportedMediaType,
    error_response,
)
from http_api.openapi import OPERATIONS, QUICK, Op, request_schemas
from http_api.parse_worker import ParseWorker, token_bound
from http_api.schema import YIELD_EVERY, Compiler, check_body, parse_query_value

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Bytes inflated per step (one zlib call, ~0.15 ms for a run of zeros).
INFLATE_STEP = 64 << 10
OFFLOAD_MIN_BYTES = 64 << 10  # smaller bodies are always parsed inline
ENCODINGS = ("gzip", "x-gzip", "deflate", "identity")
JSON_BODY = web.RequestKey("json_body", object)
REQUEST_T0 = web.RequestKey("request_t0", float)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The node's HTTP caps and timeouts (see :class:`NodeConfig`)."""

    max_body_bytes: int = (4 << 20) + (64 << 10)
    max_batch_messages: int = 10_000
    max_message_properties: int = 64
    max_batch_properties: int = 16_384
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 30.0
    max_connections: int = 1024
    yield_every: int = YIELD_EVERY

    @classmethod
    def of(cls, cfg: NodeConfig) -> HttpLimits:
        return cls(
            max_body_bytes=cfg.http_body_cap_bytes,
            max_batch_messages=cfg.max_batch_messages,
            max_message_properties=cfg.max_message_properties,
            max_batch_properties=cfg.max_batch_properties,
            header_timeout_s=cfg.http_header_timeout_ms / 1000,
            body_timeout_s=cfg.http_body_timeout_ms / 1000,
            idle_timeout_s=cfg.http_idle_timeout_ms / 1000,
            max_connections=cfg.http_max_connections,
        )


def content_encoding(request: web.BaseRequest) -> str:
    """The body's one Content-Encoding, lower case ("identity" if none);
    raises UnsupportedEncoding for anything else (415)."""
    values = request.headers.getall(hdrs.CONTENT_ENCODING, [])
    if not values:
        return "identity"
    parts = [p.strip().lower() for v in values for p in v.split(",") if p.strip()]
    if len(parts) != 1 or parts[0] not in ENCODINGS:
        raise UnsupportedEncoding(
            f"this Content-Encoding is not supported: send one of {', '.join(ENCODINGS)}"
        )
    return parts[0]


def body_timeout(limits: HttpLimits) -> BodyTimeout:
    """The 408 of a body that did not arrive within the body timeout."""
    return BodyTimeout(
        f"the body did not arrive within {limits.body_timeout_s * 1000:.0f} ms "
        "(http_body_timeout_ms)"
    )


def _too_large(cap: int, what: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body {what} more than {cap} bytes (http_max_body_bytes)")


async def read_body(request: web.Request, limits: HttpLimits) -> bytes:
    """The request body, inflated, at most ``limits.max_body_bytes`` (413)
    both as sent and inflated; within the body timeout (408)."""
    cap = limits.max_body_bytes
    declared = request.content_length
    if declared is not None and declared > cap:
        raise _too_large(cap, "declares")
    encoding = content_encoding(request)
    if encoding == "identity" and request.content.is_eof():
        # The whole body came with the headers (the usual case for a small
        # request): nothing left to wait for, so no timer to arm and cancel.
        raw = await request.content.read()
        if len(raw) > cap:
            raise _too_large(cap, "holds")
        return raw
    inflater: Any = None
    if encoding in ("gzip", "x-gzip"):
        inflater = zlib.decompressobj(31)
    out: list[bytes] = []
    sent = inflated = 0
    t0 = request.get(REQUEST_T0, time.monotonic())
    remaining = max(0.0, t0 + limits.body_timeout_s - time.monotonic())
    try:
        async with asyncio.timeout(remaining):
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                sent += len(chunk)
                if sent > cap:
                    raise _too_large(cap, "holds")
                if encoding == "deflate" and inflater is None:
                    # RFC 9110 deflate is zlib-wrapped; raw deflate is common too.
                    inflater = zlib.decompressobj(15 if chunk[0] & 0x0F == 8 else -15)
                if inflater is None:
                    out.append(chunk)
                    continue
                data = chunk
                while data:
                    if inflater.eof:
                        raise BadEncoding(f"data after the end of the {encoding} stream")
                    try:
                        piece = inflater.decompress(data, INFLATE_STEP)
                    except zlib.error:
                        raise BadEncoding(f"the body is not valid {encoding} data") from None
                    inflated += len(piece)
                    if inflated > cap:
                        raise _too_large(cap, "inflates to")
                    out.append(piece)
                    if inflater.unused_data:  # (one gzip member only)
                        raise BadEncoding(f"data after the end of the {encoding} stream")
                    data = inflater.unconsumed_tail
                    await asyncio.sleep(0)
    except TimeoutError:
        raise body_timeout(limits) from None
    if inflater is not None and sent and not inflater.eof:
        raise BadEncoding(f"the {encoding} stream ends early")
    return b"".join(out)


def op_of(request: web.Request) -> tuple[Op | None, bool]:
    """The request's operation in /openapi.json (None: no route matched)
    and whether the route matched at all."""
    info = request.match_info
    route = info.route if isinstance(info, web.UrlMappingMatchInfo) else None
    resource = route.resource if route is not None else None
    if resource is None:
        return None, False
    method = "GET" if request.method == "HEAD" else request.method
    return OPERATIONS.get((method, resource.canonical)), True


class Guard:
    """The two middlewares, bound to the node's limits."""

    def __init__(self, limits: HttpLimits, offload: bool = True) -> None:
        self.limits = limits
        self.components = request_schemas(limits.max_batch_messages, limits.max_message_properties)
        self.compiler = Compiler(self.components, QUICK)
        # Bodies that may hold more values than this are parsed and checked
        # in a helper process first (http_api/parse_worker.py); below it an
        # inline parse costs at most ~10-20 ms.
        self.inline_tokens = 16 * limits.max_batch_messages + 2 * limits.max_batch_properties + 1024
        self.worker = (
            ParseWorker(limits.max_batch_messages, limits.max_message_properties)
            if offload
            else None
        )

    async def on_cleanup(self, app: web.Application) -> None:
        if self.worker is not None:
            self.worker.close()

    @web.middleware
    async def edge(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        request[REQUEST_T0] = time.monotonic()
        try:
            if len(request.headers.getall(hdrs.AUTHORIZATION, [])) > 1:
                raise BadBody("the Authorization header is given more than once")
            declared = request.content_length
            if declared is not None and declared > self.limits.max_body_bytes:
                raise _too_large(self.limits.max_body_bytes, "declares")
            if request.body_exists:
                content_encoding(request)
        except (DLedgerError, BrokerError) as exc:
            resp = error_response(exc)
            resp.force_close()  # the body (if any) is not read
            return resp
        return await handler(request)

    @web.middleware
    async def strict(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        op, matched = op_of(request)
        try:
            if op is not None:
                self.check_params(request, op)
            if matched and request.body_exists:
                raw = await read_body(request, self.limits)
                request._read_bytes = raw  # what request.read() answers from now on
                if op is not None and op.body:
                    if request.content_type in op.body_alt:
                        pass  # the handler checks it (a binary produce body)
                    elif request.content_type == codec.BATCH_CONTENT_TYPE:
                        raise UnsupportedMediaType(
                            f"{request.method} {op.summary!r} takes JSON, "
                            f"not {codec.BATCH_CONTENT_TYPE}"
                        )
                    else:
                        request[JSON_BODY] = await self.check_json(raw, op.body)
        except (DLedgerError, BrokerError) as exc:
            resp = error_response(exc)
            if not isinstance(exc, InvalidArgument):
                resp.force_close()  # the body may be left unread
            return resp
        if (
            op is not None
            and op.body
            and JSON_BODY not in request
            and request.content_type not in op.body_alt
        ):
            try:
                request[JSON_BODY] = await self.check_json(b"", op.body)
            except BrokerError as exc:
                return error_response(exc)
        return await handler(request)

    def published_limits(self, cfg: NodeConfig) -> dict[str, int]:
        """The caps and timeouts /openapi.json publishes (``info.x-limits``),
        by their cluster-file names."""
        lim = self.limits
        return {
            "http_max_body_bytes": lim.max_body_bytes,
            "max_batch_messages": lim.max_batch_messages,
            "max_message_properties": lim.max_message_properties,
            "max_batch_properties": cfg.max_batch_properties,
            "http_header_timeout_ms": round(lim.header_timeout_s * 1000),
            "http_body_timeout_ms": round(lim.body_timeout_s * 1000),
            "http_idle_timeout_ms": round(lim.idle_timeout_s * 1000),
            "http_max_connections": lim.max_connections,
        }

    def check_params(self, request: web.Request, op: Op) -> None:
        query = request.query
        for name in query:
            schema = op.query.get(name)
            if schema is None:
                shown = name[:60]
                allowed = ", ".join(op.query) or "none"
                raise InvalidArgument(
                    f"unknown query parameter {shown!r} (allowed: {allowed})", field=shown
                )
            values = query.getall(name)
            if len(values) > 1:
                raise InvalidArgument(f"query parameter {name} is given twice", field=name)
            parse_query_value(name, values[0], schema, self.compiler)
        for name in op.required:
            if name not in query:
                raise InvalidArgument(f"query parameter {name} is required", field=name)
        for name, value in request.match_info.items():
            if name in ("topic", "group"):
                codec.check_name(value, name)  # the schema's Name, with the broker's codes
                continue
            parse_query_value(
                name, value, op.path_schemas.get(name, {"type": "string"}), self.compiler
            )

    async def check_json(self, raw: bytes, schema_name: str) -> Any:
        if (
            self.worker is not None
            and len(raw) > OFFLOAD_MIN_BYTES
            and token_bound(raw) > self.inline_tokens
        ):
            # may hold more than the caps allow: refused off the loop, or
            # checked there to be within the caps (so the parse below is short)
            await self.worker.check(raw, schema_name, self.limits.body_timeout_s)
        if not raw:
            body: Any = {}
        else:
            # The parse is one C call that cannot yield; the body cap bounds
            # it (~80 ms for 4 MiB of tiny objects). Without the collector:
            # the objects it allocates would trigger full collections of the
            # node's heap mid-parse (twice the time).
            was_on = gc.isenabled()
            gc.disable()
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise BadBody(f"the body is not JSON: {str(exc)[:120]}") from None
            finally:
                if was_on:
                    gc.enable()
        await check_body(
            self.compiler,
            {"$ref": f"#/components/schemas/{schema_name}"},
            body,
            self.limits.yield_every,
        )
        return body


GUARD_KEY = web.AppKey("guard", Guard)
