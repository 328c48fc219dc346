"""The operator and test HTTP endpoint every node serves (``/raft/*``, ``/healthz``).

It exposes the Raft runtime, not the message API (that is ``http_api/``).
Every error uses one envelope, ``{"error": {"code", "message", ...}}``, with
the status from :func:`error_status` (one table). Bad input is a 400 (cannot
parse) or 422 (parsed, not acceptable), never a 500; a 500 means a bug here.

A follower answers requests that need the leader with ``307`` and the
leader's URL in ``Location`` (a 307 keeps the method and body, so a client
may simply resend) plus ``leader``/``leader_http`` in the body; with no
known leader it answers ``503`` with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from dledger import bench
from dledger.errors import (
    ConfigError,
    DLedgerError,
    NotLeader,
    Overloaded,
    ProposalDropped,
    StorageCorrupted,
    TransferInProgress,
    Unavailable,
)
from dledger.http_auth import (
    ROUTE_ROLES,
    AuthError,
    Forbidden,
    RouteRole,
    Unauthorized,
    auth_middleware,
)
from dledger.node import (
    EntryTooLarge,
    Node,
    NodeStopped,
    OutcomeUnknown,
    TransferFailed,
    UnknownMember,
)
from dledger.statemachine import LogStateMachine

logger = logging.getLogger(__name__)

MAX_APPLIED_PAGE = 10_000
_MEMBER_OPS = ("add_learner", "promote", "remove")
_RETRY_AFTER_S = "1"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NODE_KEY = web.AppKey("node", Node)


class BadRequest(DLedgerError):
    """The request cannot be parsed (400)."""

    code = "BAD_REQUEST"


class Unprocessable(DLedgerError):
    """The request parsed but its content is not acceptable (422)."""

    code = "UNPROCESSABLE"


class RequestTimeout(DLedgerError):
    """A read or transfer did not finish in time (504); it changed nothing."""

    code = "TIMEOUT"


# The one table: first match wins, so subclasses come before their bases.
STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (Unauthorized, 401),
    (Forbidden, 403),
    (BadRequest, 400),
    (UnknownMember, 422),
    (Unprocessable, 422),
    (ConfigError, 422),
    (EntryTooLarge, 413),
    (Overloaded, 429),
    (TransferInProgress, 503),
    (Unavailable, 503),
    (NodeStopped, 503),
    (StorageCorrupted, 503),
    (OutcomeUnknown, 504),
    (RequestTimeout, 504),
    (ProposalDropped, 409),
    (TransferFailed, 409),
    (DLedgerError, 409),
)


def error_status(exc: BaseException) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body, default=str),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def _envelope(status: int, code: str, message: str, **extra: object) -> web.Response:
    headers = {"Retry-After": _RETRY_AFTER_S} if status in (429, 503) else None
    return _json({"error": {"code": code, "message": message, **extra}}, status, headers)


def _not_leader(node: Node, request: web.Request, exc: NotLeader) -> web.Response:
    leader = exc.leader_hint
    leader_http = node.http_address_of(leader) if leader else None
    if leader and leader != node.cfg.node_id and leader_http is not None:
        body = {
            "error": {
                "code": exc.code,
                "message": str(exc),
                "leader": leader,
                "leader_http": leader_http,
            }
        }
        location = f"http://{leader_http}{request.path_qs}"
        return _json(body, 307, {"Location": location})
    return _envelope(
        503, exc.code, "no leader is known; retry later", leader=None, leader_http=None
    )


def storage_fault(node: Node, exc: BaseException) -> BaseException:
    """The error to answer for ``exc``, raised serving a request. A request
    that met damage in this replica's store (StorageCorrupted) is answered
    503 and the replica stops (Node.fail_stop; exit 2 from the CLI, to be
    rebuilt) rather than go on voting and serving around a hole; a request
    refused because it stopped so is told the damage, not just "stopped"."""
    if isinstance(exc, StorageCorrupted):
        fail_stop = getattr(node, "fail_stop", None)  # a controller-mode node has none
        if fail_stop is not None:
            fail_stop(exc)
    elif isinstance(exc, NodeStopped) and isinstance(node.fatal, StorageCorrupted):
        return node.fatal
    return exc


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    node = request.app[NODE_KEY]
    try:
        return await handler(request)
    except NotLeader as exc:
        return _not_leader(node, request, exc)
    except AuthError as exc:
        extra = {"required_role": exc.needs} if isinstance(exc, Forbidden) else {}
        resp = _envelope(error_status(exc), exc.code, str(exc), **extra)
        resp.headers["WWW-Authenticate"] = exc.challenge
        return resp
    except DLedgerError as exc:
        err = storage_fault(node, exc)
        return _envelope(error_status(err), getattr(err, "code", exc.code), str(err))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = exc.reason.upper().replace(" ", "_")
        resp = _envelope(exc.status, code, f"{request.method} {request.path}: {exc.reason}")
        if "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp
    except Exception:
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return _envelope(500, "INTERNAL", "internal error (a bug: see the node's log)")


def _int_param(
    request: web.Request, name: str, default: int | None, lo: int, hi: int | None = None
) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        if default is None:
            raise BadRequest(f"query parameter {name!r} is required")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name!r} must be an integer, got {raw!r}") from None
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"within {lo}..{hi}"
        raise Unprocessable(f"query parameter {name!r} must be {bound}, got {value}")
    return value


def _timeout_s(request: web.Request, node: Node) -> float:
    ms = _int_param(request, "timeout_ms", node.cfg.request_timeout_ms, 1, 600_000)
    return ms / 1000


async def _status(request: web.Request) -> web.Response:
    return _json(request.app[NODE_KEY].status())


async def _healthz(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    body: dict[str, Any] = {
        "status": "ok" if node.running else "failed",
        "id": node.cfg.node_id,
        "role": node.role.name.lower(),
        "leader": node.leader,
    }
    if node.fatal is not None:
        body["error"] = str(node.fatal)
    return _json(body, 200 if node.running else 503)


async def _propose(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    timeout = _timeout_s(request, node)
    data = await request.read()
    try:
        async with asyncio.timeout(timeout):
            a = await node.propose_entry(data)
    except TimeoutError:
        raise OutcomeUnknown(
            f"not applied within {timeout * 1000:.0f} ms; the entry may still commit"
        ) from None
    return _json({"index": a.index, "term": a.term, "result": a.result})


async def _read(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    consistency = request.query.get("consistency", "linearizable")
    if consistency not in ("committed", "linearizable"):
        raise Unprocessable(
            f"consistency must be 'committed' or 'linearizable', got {consistency!r}"
        )
    timeout = _timeout_s(request, node)
    try:
        async with asyncio.timeout(timeout):
            rr = await node.read("committed" if consistency == "committed" else "linearizable")
    except TimeoutError:
        raise RequestTimeout(f"no read index within {timeout * 1000:.0f} ms") from None
    return _json(
        {"consistency": consistency, "index": rr.index, "applied": rr.applied, "mode": rr.mode}
    )


async def _applied(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    start = _int_param(request, "from", 1, 1)
    limit = _int_param(request, "max", 1000, 1, MAX_APPLIED_PAGE)
    sm = node.state_machine
    if not isinstance(sm, LogStateMachine):
        raise Unprocessable("this node's state machine keeps no applied records")
    records = sm.records(start, limit)
    nxt = records[-1][0] + 1 if len(records) == limit else None
    return _json({"id": node.cfg.node_id, "applied": node.applied, "records": records, "next": nxt})


async def _messages(request: web.Request) -> web.Response:
    """Recent applied payloads (UTF-8 text when they decode, else base64)."""
    node = request.app[NODE_KEY]
    start = _int_param(request, "from", 1, 1)
    limit = _int_param(request, "max", 100, 1, MAX_APPLIED_PAGE)
    sm = node.state_machine
    if not isinstance(sm, LogStateMachine):
        raise Unprocessable("this node's state machine keeps no payloads")
    out = []
    for index, term, data in sm.recent(start, limit):
        try:
            out.append({"index": index, "term": term, "text": data.decode("utf-8")})
        except UnicodeDecodeError:
            out.append({"index": index, "term": term, "base64": base64.b64encode(data).decode()})
    return _json({"id": node.cfg.node_id, "applied": node.applied, "messages": out})


async def _transfer(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    to = _int_param(request, "to", None, 1)
    timeout = _timeout_s(request, node)
    try:
        async with asyncio.timeout(timeout):
            await node.transfer_leadership(to)
    except TimeoutError:
        raise RequestTimeout(f"transfer to {to} not done within {timeout * 1000:.0f} ms") from None
    return _json({"leader": to, "leader_http": node.http_address_of(to)})


async def _members(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Unprocessable('the body must be a JSON object {"op": ..., "id": ...}')
    op, nid = body.get("op"), body.get("id")
    if op not in _MEMBER_OPS:
        raise Unprocessable(f"op must be one of {', '.join(_MEMBER_OPS)}, got {op!r}")
    if not isinstance(nid, int) or isinstance(nid, bool) or nid < 1:
        raise Unprocessable(f"id must be an integer >= 1, got {nid!r}")
    timeout = _timeout_s(request, node)
    change = {"add_learner": node.add_learner, "promote": node.promote, "remove": node.remove}[op]
    try:
        async with asyncio.timeout(timeout):
            conf = await change(nid)
    except TimeoutError:
        raise OutcomeUnknown(
            f"membership change not applied within {timeout * 1000:.0f} ms; it may still apply"
        ) from None
    return _json({"config": {"voters": list(conf.voters), "learners": list(conf.learners)}})


async def _bench(request: web.Request) -> web.Response:
    """Drive this leader from inside its own process (benchmarks/log_append.py):
    ``n`` proposals of ``size`` bytes, either ``window`` in flight or paced at
    ``rate`` per second (open loop)."""
    node = request.app[NODE_KEY]
    n = _int_param(request, "n", 10000, 1, 10_000_000)
    size = _int_param(request, "size", 100, 0, node.cfg.max_entry_bytes)
    if "rate" in request.query:
        try:
            rate = float(request.query["rate"])
        except ValueError:
            raise Unprocessable(f"rate must be a number, got {request.query['rate']!r}") from None
        if not 0 < rate <= 10_000_000:
            raise Unprocessable("rate must be in (0, 10000000]")
        return _json(await bench.paced(node, n, size, rate))
    window = _int_param(request, "window", 1000, 1, node.cfg.max_inflight_proposals)
    return _json(await bench.pipelined(node, n, size, window))


# Who may call the operator routes when auth is on (dledger.http_auth).
ADMIN_ROUTE_ROLES: dict[tuple[str, str], RouteRole] = {
    ("GET", "/raft/status"): "admin",
    ("POST", "/raft/propose"): "admin",
    ("GET", "/raft/read"): "admin",
    ("GET", "/raft/applied"): "admin",
    ("GET", "/raft/messages"): "admin",
    ("POST", "/raft/transfer"): "admin",
    ("POST", "/raft/members"): "admin",
    ("POST", "/raft/bench"): "admin",
    ("GET", "/healthz"): "any",  # public unless [auth].public leaves it out
}


def make_app(node: Node) -> web.Application:
    middlewares: list[Any] = [_errors]
    if node.cfg.auth is not None:
        middlewares.append(auth_middleware(node.cfg.auth))  # inside _errors: errors enveloped
    app = web.Application(middlewares=middlewares, client_max_size=node.cfg.http_body_cap_bytes)
    app[NODE_KEY] = node
    app[ROUTE_ROLES] = dict(ADMIN_ROUTE_ROLES)
    app.router.add_get("/raft/status", _status)
    app.router.add_post("/raft/propose", _propose)
    app.router.add_get("/raft/read", _read)
    app.router.add_get("/raft/applied", _applied)
    app.router.add_get("/raft/messages", _messages)
    app.router.add_post("/raft/transfer", _transfer)
    app.router.add_post("/raft/members", _members)
    app.router.add_get("/healthz", _healthz)
    app.router.add_post("/raft/bench", _bench)
    return app


class AdminServer:
    """Serves :func:`make_app` on the node's http address."""

    def __init__(self, node: Node, app: web.Application | None = None) -> None:
        self.node = node
        self._runner = web.AppRunner(
            app if app is not None else make_app(node), access_log=None, shutdown_timeout=2.0
        )

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.node.cfg.http_host, self.node.cfg.http_port, reuse_address=True
        )
        await site.start()

    async def stop(self) -> None:
        await self._runner.cleanup()
