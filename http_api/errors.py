"""The one table from errors to HTTP statuses for the /v1 API, and the envelope.

Every error response is ``{"error": {"code", "message", ...}}``; a broker
error adds ``field`` (the request field at fault) and its details (e.g. the
valid ``min_offset``/``max_offset`` of a 416). ``429`` and ``503`` carry
``Retry-After``; a follower answers ``307`` with ``Location`` of the leader.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from broker_adapter.errors import (
    BrokerError,
    InvalidArgument,
    MalformedCommand,
    MessageTooLarge,
    OffsetOutOfRange,
    ProducerError,
    TopicExists,
    UnknownTopic,
)
from dledger.admin_http import STATUS as ADMIN_STATUS
from dledger.errors import (
    DLedgerError,
)

RETRY_AFTER_S = "1"


class LeaderNotReady(DLedgerError):
    """This node leads but has not yet applied an entry of its own term."""

    code = "LEADER_NOT_READY"


class PayloadTooLarge(DLedgerError):
    """The request body (or what it inflates to) is above the node's cap (413)."""

    code = "PAYLOAD_TOO_LARGE"


class UnsupportedEncoding(DLedgerError):
    """A Content-Encoding the node does not decode (415)."""

    code = "UNSUPPORTED_CONTENT_ENCODING"


class UnsupportedMediaType(DLedgerError):
    """A binary produce body where it is not taken (415)."""

    code = "UNSUPPORTED_MEDIA_TYPE"


BATCH_REFUSED = (
    "a broker-group node takes JSON produce bodies only (its agent routes each "
    "message by queue); send application/json"
)


class BadEncoding(DLedgerError):
    """A body that does not decode as its Content-Encoding says (400)."""

    code = "BAD_CONTENT_ENCODING"


class BadBody(DLedgerError):
    """A body that is not JSON, or a malformed header such as a repeated
    Authorization (400)."""

    code = "BAD_REQUEST"


class BodyTimeout(DLedgerError):
    """The body did not arrive within the node's body timeout (408)."""

    code = "REQUEST_TIMEOUT"


# First match wins: subclasses before their bases. The broker's errors come
# first; the node's errors are the operator API's table, shared, not copied.
STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (PayloadTooLarge, 413),
    (UnsupportedEncoding, 415),
    (UnsupportedMediaType, 415),
    (BadEncoding, 400),
    (BadBody, 400),
    (BodyTimeout, 408),
    (MessageTooLarge, 413),
    (OffsetOutOfRange, 416),
    (UnknownTopic, 404),
    (TopicExists, 409),
    (ProducerError, 409),
    (MalformedCommand, 400),
    (InvalidArgument, 422),
    (BrokerError, 409),
    (LeaderNotReady, 503),
    *ADMIN_STATUS,
)


def status_of(exc: BaseException) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def json_response(
    body: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, headers=headers, content_type="application/json"
    )


def envelope(status: int, code: str, message: str, **extra: object) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else None
    return json_response({"error": {"code": code, "message": message, **extra}}, status, headers)


def error_response(exc: BaseException) -> web.Response:
    status = status_of(exc)
    if isinstance(exc, BrokerError):
        d = exc.to_dict()
        code, message = str(d.pop("code")), str(d.pop("message"))
        return envelope(status, code, message, **d)
    code = getattr(exc, "code", "INTERNAL")
    return envelope(status, str(code), str(exc))
