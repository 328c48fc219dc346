"""The /v1 message API every node serves next to ``/raft/*``.

Routes (JSON via orjson; message values are base64, or UTF-8 text when the
request says ``"encoding": "utf-8"``)::

    POST   /v1/topics                                  create {name, queues}
    GET    /v1/topics                                  list
    GET    /v1/topics/{topic}                          describe (queues, min/max offsets)
    PATCH  /v1/topics/{topic}                          update {queues} (grow only)
    DELETE /v1/topics/{topic}                          delete
    POST   /v1/topics/{topic}/messages                 produce a batch
    GET    /v1/topics/{topic}/queues/{queue}/messages  consume (long-poll)
    POST   /v1/producers                               {producer_id?} -> {producer_id, epoch}
    GET    /v1/groups/{group}/offsets                  committed offsets (?topic=)
    POST   /v1/groups/{group}/offsets                  commit {offsets: [{topic, queue, offset}]}
    POST   /v1/groups/{group}/reset                    {topic, to: earliest|latest|timestamp}
    PUT    /v1/retention                               {max_bytes, max_age_ms, producer_idle_ms}
    GET    /v1/cluster                                 node status + broker stats + epoch map
    POST   /v1/cluster/transfer-leadership             {to}
    POST   /v1/cluster/members                         {op: add_learner|promote|remove, id}
    GET    /readyz                                     200 when a leader is known and caught up
    GET    /metrics                                    Prometheus text format
    GET    /openapi.json                               OpenAPI 3.1 document of every route

Writes go through the Raft log and answer after commit *and* apply on this
node (the leader). Reads are served from this node's applied state: with
``consistency=committed`` (default) by any replica up to its confirm
offset, with ``consistency=linearizable`` only by the leader after a lease
or ReadIndex barrier. This module holds no broker or Raft rule: it parses,
calls the node and the adapter, and maps errors in one table
(:mod:`http_api.errors`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from broker_adapter import codec
from broker_adapter.codec import CommandKind, Limits, MessageRow, ResetMode
from broker_adapter.errors import (
    BrokerError,
    InvalidArgument,
    InvalidTopicName,
    TooManyProperties,
)
from broker_adapter.node_sm import BrokerStateMachine
from broker_adapter.state import (
    OffsetsResult,
    ProduceResult,
    ProducerResult,
    ReadResult,
    RetentionResult,
    StoredMessage,
    TopicInfo,
)
from dledger import faults
from dledger.admin_http import BadRequest, Unprocessable, storage_fault
from dledger.config import DEFAULT_PUBLIC_PATHS
from dledger.core.types import Role
from dledger.errors import DLedgerError, NotLeader
from dledger.http_auth import ROUTE_ROLES as APP_ROUTE_ROLES
from dledger.http_auth import RouteRole
from dledger.metrics import Histogram, labels_text, render_histogram
from dledger.node import Node, NodeStopped, OutcomeUnknown
from http_api import arrow
from http_api.errors import (
    BATCH_REFUSED,
    LeaderNotReady,
    UnsupportedMediaType,
    envelope,
    error_response,
    json_response,
)
from http_api.guard import GUARD_KEY, JSON_BODY, Guard
from http_api.openapi import OPERATIONS, openapi_document
from http_api.schema import YIELD_EVERY

logger = logging.getLogger(__name__)

MAX_WAIT_MS = 30_000
MAX_MESSAGES = arrow.JSON_MAX_MESSAGES
MAX_READ_BYTES = 8 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The role each route needs when the cluster file turns auth on
# (dledger.http_auth): "any" is any valid token, "public" none at all.
ROUTE_ROLES: dict[tuple[str, str], RouteRole] = {
    ("POST", "/v1/topics"): "admin",
    ("GET", "/v1/topics"): "any",
    ("GET", "/v1/topics/{topic}"): "any",
    ("PATCH", "/v1/topics/{topic}"): "admin",
    ("DELETE", "/v1/topics/{topic}"): "admin",
    ("POST", "/v1/topics/{topic}/messages"): "produce",
    ("GET", "/v1/topics/{topic}/queues/{queue}/messages"): "consume",
    ("POST", "/v1/producers"): "produce",
    ("GET", "/v1/groups/{group}/offsets"): "consume",
    ("POST", "/v1/groups/{group}/offsets"): "consume",
    ("POST", "/v1/groups/{group}/reset"): "consume",
    ("PUT", "/v1/retention"): "admin",
    ("GET", "/v1/cluster"): "admin",
    ("POST", "/v1/cluster/transfer-leadership"): "admin",
    ("POST", "/v1/cluster/members"): "admin",
    ("GET", "/readyz"): "any",
    ("GET", "/metrics"): "any",
    ("GET", "/openapi.json"): "any",
}
UNMATCHED_ROUTE = "<unmatched>"  # one label for every 404 path: bounded cardinality
PRODUCE_ROUTE = "/v1/topics/{topic}/messages"
PRODUCE_SCHEMA = str(OPERATIONS[("POST", PRODUCE_ROUTE)].body)
# What the express lane's produce answers: the success body, or an error.
Answer = bytes | web.Response
# What a composition's middleware does to a checked produce body (see
# http_api.server.PRODUCE_HOOKS): an error answer, or None to go on.
ProduceHook = Callable[[str, dict[str, Any]], "web.Response | None"]


class BrokerApi:
    """The handlers, bound to one node and its broker state machine."""

    def __init__(
        self,
        node: Node,
        sm: BrokerStateMachine,
        auto_create_queues: int = 0,
        limits: Limits | None = None,
    ) -> None:
        self.node = node
        self.sm = sm
        self.auto_create_queues = auto_create_queues
        self.limits = limits or Limits(
            max_batch_bytes=node.cfg.max_entry_bytes,
            max_message_bytes=min(1 << 20, node.cfg.max_entry_bytes - 4096),
            max_batch_messages=node.cfg.max_batch_messages,
            max_properties=node.cfg.max_message_properties,
        )
        self._applied = asyncio.Event()
        self._waiters = 0
        # (method, route, status) -> latency histogram (count and rate included)
        self.requests: dict[tuple[str, str, int], Histogram] = {}
        self.express_answers = 0  # produce requests the express lane took
        sm.add_listener(self._on_apply)

    # -- plumbing -------------------------------------------------------------
    def _on_apply(self) -> None:
        if self._waiters:
            ev, self._applied = self._applied, asyncio.Event()
            ev.set()

    def routes(self) -> list[web.RouteDef]:
        g = self._guard
        return [
            web.post("/v1/topics", g(self.create_topic)),
            web.get("/v1/topics", g(self.list_topics)),
            web.get("/v1/topics/{topic}", g(self.describe_topic)),
            web.patch("/v1/topics/{topic}", g(self.update_topic)),
            web.delete("/v1/topics/{topic}", g(self.delete_topic)),
            web.post("/v1/topics/{topic}/messages", g(self.produce)),
            web.get("/v1/topics/{topic}/queues/{queue}/messages", g(self.consume)),
            web.post("/v1/producers", g(self.register_producer)),
            web.get("/v1/groups/{group}/offsets", g(self.get_offsets)),
            web.post("/v1/groups/{group}/offsets", g(self.commit_offsets)),
            web.post("/v1/groups/{group}/reset", g(self.reset_group)),
            web.put("/v1/retention", g(self.set_retention)),
            web.get("/v1/cluster", g(self.cluster)),
            web.post("/v1/cluster/transfer-leadership", g(self.transfer_leadership)),
            web.post("/v1/cluster/members", g(self.members)),
            web.get("/readyz", g(self.readyz)),
            web.get("/metrics", g(self.metrics)),
            web.get("/openapi.json", g(self.openapi)),
        ]

    def _guard(self, fn: Handler) -> Handler:
        """Every error becomes the envelope here, so nothing reaches the
        admin app's middleware as an unknown exception (no 500s)."""

        @functools.wraps(fn)
        async def wrapped(request: web.Request) -> web.StreamResponse:
            return await self._handle(fn, request)

        return wrapped

    @web.middleware
    async def observe(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Outermost middleware: every answer of the node's HTTP server
        (operator routes, 401s and 404s included) by method, route, status."""
        t0 = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:  # redirects the inner layers let through
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away first (nginx's code), not a server error
            raise
        finally:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else UNMATCHED_ROUTE
            self._observe(request.method, route, status, t0)

    def _observe(self, method: str, route: str, status: int, t0: float) -> None:
        key = (method, route, status)
        h = self.requests.get(key)
        if h is None:
            h = self.requests[key] = Histogram()
        h.observe(time.perf_counter() - t0)

    async def _handle(self, fn: Handler, request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = (exc.reason or "error").upper().replace(" ", "_")
            return envelope(exc.status, code, f"{request.method} {request.path}: {exc.reason}")
        except Exception as exc:
            return self._error_answer(exc, request.method, request.path_qs)

    def _error_answer(self, exc: Exception, method: str, path_qs: str) -> web.Response:
        """A handler's error as its answer: NOT_LEADER's redirect, the
        envelope, or a 500 (logged: a bug)."""
        if isinstance(exc, NotLeader):
            return self._not_leader(path_qs, exc)
        resp = error_response(storage_fault(self.node, exc))
        if resp.status == 500:
            logger.error("unhandled error serving %s %s", method, path_qs, exc_info=exc)
            return envelope(500, "INTERNAL", "internal error (a bug: see the node's log)")
        return resp

    def _not_leader(self, path_qs: str, exc: NotLeader) -> web.Response:
        leader = exc.leader_hint
        node = self.node
        leader_http = node.http_address_of(leader) if leader else None
        if leader and leader != node.cfg.node_id and leader_http is not None:
            return json_response(
                {
                    "error": {
                        "code": exc.code,
                        "message": str(exc),
                        "leader": leader,
                        "leader_http": leader_http,
                    }
                },
                307,
                {"Location": f"http://{leader_http}{path_qs}"},
            )
        return envelope(503, exc.code, "no leader is known; retry later", leader=None)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        checked = request.get(JSON_BODY)
        if isinstance(checked, dict):  # read, parsed and checked by http_api.guard
            return checked
        raw = await request.read()  # bounded by the app's client_max_size (413)
        if not raw:
            return {}
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise Unprocessable("the body must be a JSON object")
        return body

    def _timeout_s(self, request: web.Request) -> float:
        return _int_q(request, "timeout_ms", self.node.cfg.request_timeout_ms, 1, 600_000) / 1000

    def _require_leader(self) -> None:
        node = self.node
        if not node.running:  # stopping, or stopped on an error (said by storage_fault)
            raise NodeStopped(f"node {node.cfg.node_id} is not running")
        if node.role is not Role.LEADER:
            raise NotLeader(node.leader)
        if not node.leader_ready():
            raise LeaderNotReady("this leader has not applied an entry of its term yet")

    async def _propose(self, request: web.Request, data: bytes) -> object:
        """Propose one command; its apply result, raised when it is an error."""
        return await self._propose_within(self._timeout_s(request), data)

    async def _propose_within(self, timeout: float, data: bytes) -> object:
        self._require_leader()
        try:
            async with asyncio.timeout(timeout):
                applied = await self.node.propose_entry(data)
        except TimeoutError:
            raise OutcomeUnknown(
                f"not applied within {timeout * 1000:.0f} ms; it may still commit"
            ) from None
        if isinstance(applied.result, BrokerError):
            raise applied.result
        return applied.result

    @staticmethod
    def _now_ms() -> int:
        return int(time.time() * 1000)

    # -- topics -----------------------------------------------------------------
    async def create_topic(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name = codec.check_name(body.get("name"))
        if name in (".", ".."):  # a URL path cannot address them
            raise InvalidTopicName(f"topic name {name!r} cannot be addressed in a URL", "name")
        queues = codec.check_queue_count(body.get("queues", 8))
        data = codec.encode_topic(CommandKind.CREATE_TOPIC, name, self._now_ms(), queues)
        res = await self._propose(request, data)
        assert isinstance(res, TopicInfo)
        return json_response(_topic_json(res), 201)

    async def list_topics(self, request: web.Request) -> web.Response:
        await self._read_barrier(request)
        b = self.sm.broker
        return json_response({"topics": [_topic_json(b.topic(n)) for n in b.topic_names()]})

    async def describe_topic(self, request: web.Request) -> web.Response:
        await self._read_barrier(request)
        return json_response(_topic_json(self.sm.broker.topic(request.match_info["topic"])))

    async def update_topic(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name = codec.check_name(request.match_info["topic"])
        queues = codec.check_queue_count(body.get("queues"))
        data = codec.encode_topic(CommandKind.UPDATE_TOPIC, name, self._now_ms(), queues)
        res = await self._propose(request, data)
        assert isinstance(res, TopicInfo)
        return json_response(_topic_json(res))

    async def delete_topic(self, request: web.Request) -> web.Response:
        name = codec.check_name(request.match_info["topic"])
        data = codec.encode_topic(CommandKind.DELETE_TOPIC, name, self._now_ms())
        await self._propose(request, data)
        return json_response({"deleted": name})

    # -- produce ----------------------------------------------------------------
    async def produce(self, request: web.Request) -> web.Response:
        topic = codec.check_name(request.match_info["topic"])
        if request.content_type == codec.BATCH_CONTENT_TYPE:
            raw = await request.read()  # read, inflated and capped by http_api.guard
            answer = await self.produce_batch(topic, raw, self._timeout_s(request))
            return json_response(answer)
        body = await self._body(request)
        return json_response(await self._produce(topic, body, self._timeout_s(request)))

    async def produce_express(
        self,
        guard: Guard,
        hooks: tuple[ProduceHook, ...],
        topic: str,
        raw: bytes,
        target: str,
        timeout_ms: int | None,
        binary: bool = False,
    ) -> Answer:
        """A produce request the express lane took (:mod:`http_api.protocol`):
        the checks and answers of the route's middlewares and handler (the
        schema, the produce, the error envelope, the request metrics), without
        aiohttp's request and response objects. ``target`` is the request
        target as sent (the redirect of NOT_LEADER repeats it); ``timeout_ms``
        its query parameter, checked by the lane; ``binary``: the body is
        ``application/vnd.dledger.batch``; ``hooks``: what the
        composition's middlewares do to a checked produce body, in their
        order (:data:`http_api.server.PRODUCE_HOOKS`). The answer is the
        success body, or the error response."""
        t0 = time.perf_counter()
        status = 500
        self.express_answers += 1
        try:
            if binary:
                try:
                    if hooks:  # a composition's hooks read JSON bodies only
                        raise UnsupportedMediaType(BATCH_REFUSED)
                    ms = self.node.cfg.request_timeout_ms if timeout_ms is None else timeout_ms
                    answer = await self.produce_batch(topic, raw, ms / 1000)
                except Exception as exc:
                    resp = self._error_answer(exc, "POST", target)
                    status = resp.status
                    return resp
                status = 200
                return orjson.dumps(answer)
            try:
                body = await guard.check_json(raw, PRODUCE_SCHEMA)
            except (DLedgerError, BrokerError) as exc:
                resp = error_response(exc)  # 400 not JSON, 422 naming the field
            else:
                try:
                    for hook in hooks:
                        refused = hook(topic, body)
                        if refused is not None:
                            status = refused.status
                            return refused
                    ms = self.node.cfg.request_timeout_ms if timeout_ms is None else timeout_ms
                    answer = await self._produce(topic, body, ms / 1000)
                except Exception as exc:
                    resp = self._error_answer(exc, "POST", target)
                else:
                    status = 200
                    return orjson.dumps(answer)
            status = resp.status
            return resp
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self._observe("POST", PRODUCE_ROUTE, status, t0)

    async def _produce(self, topic: str, body: dict[str, Any], timeout: float) -> object:
        """A checked produce body proposed and applied: the answer's JSON."""
        msgs = await parse_messages_stepwise(
            body.get("messages"), self.limits, self.node.cfg.max_batch_properties
        )
        pid = _opt_int(body, "producer_id", 0, 1 << 64)
        epoch = _opt_int(body, "epoch", 0, 1 << 32)
        seq = _opt_int(body, "sequence", 0, 1 << 62)
        if (pid is None) != (seq is None):
            raise InvalidArgument(
                "producer_id and sequence go together (idempotent produce)",
                field="sequence" if seq is None else "producer_id",
            )
        self._before_produce(topic)
        data = await encode_produce_stepwise(
            topic,
            msgs,
            self._now_ms(),
            producer_id=pid or 0,
            epoch=epoch or 0,
            base_seq=-1 if seq is None else seq,
            auto_create_queues=self.auto_create_queues,
            limits=self.limits,
        )
        return await self._propose_produce(topic, data, timeout)

    async def produce_batch(self, topic: str, raw: bytes, timeout: float) -> object:
        """A binary produce body (``application/vnd.dledger.batch``, see
        :mod:`broker_adapter.codec`): its records are checked (CRC, layout,
        the JSON path's caps) in slices with a yield between them, and
        proposed as they are. The answer is the JSON one."""
        head = codec.batch_head(raw)
        limits = self.limits
        codec.check_produce(
            topic, head.count, head.producer_id, head.epoch, head.sequence,
            self.auto_create_queues, limits,
        )  # fmt: skip
        pos, props, done = codec.BATCH_HEAD_SIZE, 0, 0
        while done < head.count:
            n = min(YIELD_EVERY, head.count - done)
            pos, seen = codec.check_batch_records(raw, pos, done, n, limits)
            props += seen
            done += n
            if done < head.count:
                await asyncio.sleep(0)
        if pos != len(raw):
            raise InvalidArgument(
                f"{len(raw) - pos} bytes after the {head.count} records the head announces",
                field="messages",
            )
        _check_batch_properties(props, self.node.cfg.max_batch_properties)
        self._before_produce(topic)
        data = codec.assemble_produce(
            topic,
            head.count,
            [raw[codec.BATCH_HEAD_SIZE :]],
            self._now_ms(),
            producer_id=head.producer_id,
            epoch=head.epoch,
            base_seq=head.sequence,
            auto_create_queues=self.auto_create_queues,
            limits=limits,
        )
        return await self._propose_produce(topic, data, timeout)

    def _before_produce(self, topic: str) -> None:
        self._require_leader()
        if not self.auto_create_queues and not self.sm.broker.has_topic(topic):
            self.sm.broker.topic(topic)  # raises UnknownTopic, before proposing

    async def _propose_produce(self, topic: str, data: bytes, timeout: float) -> object:
        if faults.on(faults.ACK_BEFORE_COMMIT):  # planted bug (dledger/faults.py), tests only
            cmd = codec.decode_command(data).body
            assert isinstance(cmd, codec.Produce)
            queues_asked: list[int | None] = []
            pos = cmd.records_start
            for _ in range(cmd.count):
                size, q, _shard, _tag = codec.record_header(data, pos)
                queues_asked.append(None if q < 0 else q)
                pos += size
            return faults.ack_before_commit(self.node, self.sm.broker, topic, queues_asked, data)
        res = await self._propose_within(timeout, data)
        assert isinstance(res, ProduceResult)
        return produce_json(res)

    async def register_producer(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        pid = _opt_int(body, "producer_id", 1, 1 << 64) or 0
        res = await self._propose(request, codec.encode_register_producer(self._now_ms(), pid))
        assert isinstance(res, ProducerResult)
        return json_response({"producer_id": res.producer_id, "epoch": res.epoch})

    # -- consume ----------------------------------------------------------------
    async def _read_barrier(self, request: web.Request) -> str:
        consistency = request.query.get("consistency", "committed")
        if consistency not in ("committed", "linearizable"):
            raise InvalidArgument(
                f"consistency must be 'committed' or 'linearizable', got {consistency!r}",
                field="consistency",
            )
        if consistency == "linearizable" and not faults.on(faults.LIN_READ_NO_LEASE):  # planted bug
            timeout = self._timeout_s(request)
            try:
                async with asyncio.timeout(timeout):
                    await self.node.read("linearizable")
            except TimeoutError:
                raise OutcomeUnknown(f"no read index within {timeout * 1000:.0f} ms") from None
        else:
            await self.node.read("committed")  # raises NodeStopped when not running
        return consistency

    async def consume(self, request: web.Request) -> web.Response:
        """JSON, or with ``Accept: application/vnd.apache.arrow.stream`` an
        Arrow IPC stream of the same page (:mod:`http_api.arrow`)."""
        as_arrow = arrow.wants_arrow(request.headers.get("Accept", ""))
        pa = arrow.load_pyarrow() if as_arrow else None
        if as_arrow and pa is None:
            return envelope(
                406,
                "ARROW_UNAVAILABLE",
                f"this node cannot answer {arrow.ARROW_STREAM}: pyarrow is not installed "
                "on it; ask for application/json",
            )
        topic = codec.check_name(request.match_info["topic"])
        try:
            queue = int(request.match_info["queue"])
        except ValueError:
            raise InvalidArgument("queue must be an integer", field="queue") from None
        offset = _int_q(request, "offset", 0, 0, 1 << 62)
        max_messages = _int_q(
            request, "max_messages", 32, 1, arrow.ARROW_MAX_MESSAGES if as_arrow else MAX_MESSAGES
        )
        max_bytes = _int_q(request, "max_bytes", 1 << 20, 1, MAX_READ_BYTES)
        wait_ms = _int_q(request, "wait_ms", 0, 0, MAX_WAIT_MS)
        tag = request.query.get("tag") or None
        as_text = request.query.get("encoding", "base64") == "utf-8"
        await self._read_barrier(request)
        broker = self.sm.broker
        deadline = time.monotonic() + wait_ms / 1000
        if pa is not None:
            cols = broker.read_columns(topic, queue, offset, max_messages, max_bytes, tag)
            while not len(cols) and await self._wait_applied(deadline):
                cols = broker.read_columns(
                    topic, queue, cols.next_offset, max_messages, max_bytes, tag
                )
            body = arrow.ipc_stream(pa, arrow.record_batch(pa, topic, queue, cols))
            return web.Response(
                body=memoryview(body),
                headers=arrow.headers(cols, broker.confirm_offset),
                content_type=arrow.ARROW_STREAM,
            )
        res = broker.read(topic, queue, offset, max_messages, max_bytes, tag)
        while not res.messages and await self._wait_applied(deadline):
            res = broker.read(topic, queue, res.next_offset, max_messages, max_bytes, tag)
        return json_response(_read_json(res, broker.confirm_offset, as_text))

    async def _wait_applied(self, deadline: float) -> bool:
        """Long-poll: wait for the next apply until ``deadline``; False when
        the wait is over (deadline passed, or the node stopped)."""
        if time.monotonic() >= deadline:
            return False
        self._waiters += 1
        try:
            ev = self._applied
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await ev.wait()
        except TimeoutError:
            pass
        finally:
            self._waiters -= 1
        return bool(self.node.running)

    # -- groups -------------------------------------------------------------------
    async def get_offsets(self, request: web.Request) -> web.Response:
        group = codec.check_name(request.match_info["group"], "group")
        topic = request.query.get("topic")
        await self._read_barrier(request)
        offs = self.sm.broker.group_offsets(group, topic)
        return json_response(
            {
                "group": group,
                "offsets": [{"topic": t, "queue": q, "offset": o} for (t, q), o in offs.items()],
            }
        )

    async def commit_offsets(self, request: web.Request) -> web.Response:
        group = codec.check_name(request.match_info["group"], "group")
        body = await self._body(request)
        items = body.get("offsets")
        if not isinstance(items, list) or not items:
            raise InvalidArgument("offsets must be a non-empty list", field="offsets")
        offs: list[tuple[str, int, int]] = []
        for k, it in enumerate(items):
            if not isinstance(it, dict):
                raise InvalidArgument("each offset must be an object", field=f"offsets[{k}]")
            t = codec.check_name(it.get("topic"))
            q = _req_int(it, "queue", 0, codec.MAX_QUEUES, f"offsets[{k}].")
            o = _req_int(it, "offset", 0, 1 << 62, f"offsets[{k}].")
            offs.append((t, q, o))
        data = codec.encode_commit_offsets(group, offs, self._now_ms())
        res = await self._propose(request, data)
        assert isinstance(res, OffsetsResult)
        return json_response(_offsets_json(res))

    async def reset_group(self, request: web.Request) -> web.Response:
        group = codec.check_name(request.match_info["group"], "group")
        body = await self._body(request)
        topic = codec.check_name(body.get("topic"))
        to = body.get("to", "earliest")
        modes = {"earliest": ResetMode.EARLIEST, "latest": ResetMode.LATEST}
        ts = 0
        if to == "timestamp":
            mode = ResetMode.TIMESTAMP
            ts = _req_int(body, "timestamp_ms", 0, 1 << 62)
        elif isinstance(to, str) and to in modes:
            mode = modes[to]
        else:
            raise InvalidArgument(
                "to must be 'earliest', 'latest' or 'timestamp'", field="to", got=str(to)
            )
        data = codec.encode_reset_group(group, topic, mode, self._now_ms(), ts)
        res = await self._propose(request, data)
        assert isinstance(res, OffsetsResult)
        return json_response(_offsets_json(res))

    async def set_retention(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        data = codec.encode_retention(
            self._now_ms(),
            _opt_int(body, "max_bytes", 0, 1 << 62) or 0,
            _opt_int(body, "max_age_ms", 0, 1 << 62) or 0,
            _opt_int(body, "producer_idle_ms", 0, 1 << 62) or 0,
        )
        res = await self._propose(request, data)
        assert isinstance(res, RetentionResult)
        return json_response(
            {
                "max_bytes": res.max_bytes,
                "max_age_ms": res.max_age_ms,
                "producer_idle_ms": res.producer_idle_ms,
            }
        )

    # -- cluster --------------------------------------------------------------------
    async def cluster(self, request: web.Request) -> web.Response:
        st = self.node.status()
        b = self.sm.broker
        st["broker"] = {
            **b.stats(),
            "epoch_map": {str(t): p for t, p in sorted(b.epochs.items())},
        }
        return json_response(st)

    async def transfer_leadership(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        to = _req_int(body, "to", 1, 1 << 31)
        timeout = self._timeout_s(request)
        try:
            async with asyncio.timeout(timeout):
                await self.node.transfer_leadership(to)
        except TimeoutError:
            raise OutcomeUnknown(f"transfer to {to} not done within {timeout:.1f} s") from None
        return json_response({"leader": to, "leader_http": self.node.http_address_of(to)})

    async def members(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ops = {
            "add_learner": self.node.add_learner,
            "promote": self.node.promote,
            "remove": self.node.remove,
        }
        op = body.get("op")
        if not isinstance(op, str) or op not in ops:
            raise InvalidArgument(f"op must be one of {', '.join(ops)}", field="op")
        nid = _req_int(body, "id", 1, 1 << 31)
        timeout = self._timeout_s(request)
        try:
            async with asyncio.timeout(timeout):
                conf = await ops[op](nid)
        except TimeoutError:
            raise OutcomeUnknown(
                f"membership change not applied within {timeout:.1f} s; it may still apply"
            ) from None
        return json_response(
            {"config": {"voters": list(conf.voters), "learners": list(conf.learners)}}
        )

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready: running, a leader is known, and this node applied what it
        knows to be committed (a lagging replica is not ready)."""
        node = self.node
        st = node.status() if node.running else {}
        lag = int(st.get("commit", 0)) - int(st.get("applied", 0))
        ok = node.running and node.leader != 0 and lag <= 0
        body = {"ready": ok, "role": node.role.name.lower(), "leader": node.leader, "lag": lag}
        if not ok:
            return envelope(503, "NOT_READY", "no leader known, not running or lagging", **body)
        return json_response(body)

    async def metrics(self, request: web.Request) -> web.Response:
        node = self.node
        st = node.status()
        b = self.sm.broker.stats()
        counters = st.get("node", {})
        commit = int(st.get("commit", 0))
        lines: list[str] = []

        def one(name: str, value: float, help_: str, kind: str = "gauge") -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name} {value}")

        one("dledger_term", st.get("term", 0), "current Raft term")
        one("dledger_is_leader", int(node.role is Role.LEADER), "1 on the leader")
        one("dledger_commit_index", commit, "Raft commit index")
        one("dledger_applied_index", node.applied, "last applied log index")
        one("dledger_apply_lag", max(0, commit - node.applied), "commit index - applied index")
        one("dledger_confirm_offset", b["confirm_offset"], "CommitLog confirm offset (bytes)")
        one("dledger_stored_messages", b["stored_messages"], "messages retained")
        one("dledger_stored_bytes", b["stored_bytes"], "message bytes retained")
        one(
            "dledger_elections_total",
            counters.get("elections", 0),
            "elections this node started (candidate in a new term)",
            "counter",
        )
        one(
            "dledger_leader_changes_total",
            counters.get("leader_changes", 0),
            "times the leader this node knows changed (to none included)",
            "counter",
        )
        one("dledger_fsyncs_total", counters.get("syncs", 0), "group commits synced", "counter")
        one(
            "dledger_http_express_total",
            self.express_answers,
            "produce requests the express lane answered (http_api/protocol.py)",
            "counter",
        )
        one(
            "dledger_loop_lag_max_seconds",
            float(counters.get("loop_lag_ms_max", 0.0)) / 1000,
            "the longest event-loop lag this node measured (Raft shares the loop with HTTP)",
        )
        loop_lag = getattr(node, "loop_lag_seconds", None)
        if isinstance(loop_lag, Histogram):
            lines += render_histogram(
                "dledger_loop_lag_seconds",
                "event-loop lag of this node (Raft ticks wait this long behind other work)",
                [((), loop_lag)],
            )
        fsync = node.fsync_seconds
        if fsync is not None:
            lines += render_histogram(
                "dledger_fsync_seconds",
                "duration of storage writes that fsync (one per group commit)",
                [((), fsync)],
            )
        reqs = sorted(self.requests.items())
        lines.append("# HELP dledger_http_requests_total HTTP requests by method, route, status")
        lines.append("# TYPE dledger_http_requests_total counter")
        for (method, route, status), h in reqs:
            labels = labels_text((("method", method), ("route", route), ("status", str(status))))
            lines.append(f"dledger_http_requests_total{labels} {h.count}")
        lines += render_histogram(
            "dledger_http_request_duration_seconds",
            "HTTP request latency by method, route and status",
            [((("method", m), ("route", r), ("status", str(s_))), h) for (m, r, s_), h in reqs],
        )
        return web.Response(
            text="\n".join(lines) + "\n",
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def openapi(self, request: web.Request) -> web.Response:
        auth = self.node.cfg.auth
        guard = request.app.get(GUARD_KEY)
        doc = openapi_document(
            request.app,
            {k: str(v) for k, v in request.app[APP_ROUTE_ROLES].items()},
            auth_on=auth is not None,
            public=auth.public if auth is not None else DEFAULT_PUBLIC_PATHS,
            schemas=guard.components if guard is not None else None,
            limits=guard.published_limits(self.node.cfg) if guard is not None else None,
        )
        return json_response(doc)


# ---------------------------------------------------------------------------
# parsing helpers


def _int_q(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise InvalidArgument(f"{name} must be an integer, got {raw[:40]!r}", field=name) from None
    if not lo <= v <= hi:
        raise InvalidArgument(f"{name} must be within {lo}..{hi}, got {v}", field=name)
    return v


def _opt_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise InvalidArgument(f"{name} must be an integer within {lo}..{hi - 1}", field=name)
    return v


def _req_int(d: dict[str, Any], name: str, lo: int, hi: int, prefix: str = "") -> int:
    v = d.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise InvalidArgument(
            f"{prefix}{name} must be an integer within {lo}..{hi - 1}", field=prefix + name
        )
    return v


def _str_field(m: dict[str, Any], name: str, where: str) -> str:
    v = m.get(name, "")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise InvalidArgument(f"{where}.{name} must be a string", field=f"{where}.{name}")
    return v


def _check_batch_properties(total: int, cap: int) -> None:
    if total > cap:
        raise TooManyProperties(
            f"{total} properties in this batch, at most {cap} (max_batch_properties)", "messages"
        )


async def parse_messages_stepwise(
    raw_msgs: object,
    limits: Limits,
    max_batch_properties: int | None = None,
    step: int = YIELD_EVERY,
) -> list[MessageRow]:
    """:func:`parse_messages` in slices of ``step`` messages with a yield to
    the event loop between them (the loop also runs Raft). The batch and
    property caps are checked before any message is parsed."""
    if not isinstance(raw_msgs, list) or not raw_msgs:
        raise InvalidArgument("messages must be a non-empty list", field="messages")
    if len(raw_msgs) > limits.max_batch_messages:
        raise InvalidArgument(
            f"{len(raw_msgs)} messages, at most {limits.max_batch_messages} per batch",
            field="messages",
        )
    if max_batch_properties is not None:
        total = 0
        for m in raw_msgs:
            if type(m) is dict:
                props = m.get("properties")
                if type(props) is dict:
                    total += len(props)
        _check_batch_properties(total, max_batch_properties)
    if len(raw_msgs) <= step:
        return parse_messages(raw_msgs)
    out: list[MessageRow] = []
    now = int(time.time() * 1000)
    for start in range(0, len(raw_msgs), step):
        out += parse_messages(raw_msgs[start : start + step], now, start)
        await asyncio.sleep(0)
    return out


async def encode_produce_stepwise(
    topic: str,
    rows: list[MessageRow],
    ts_ms: int,
    *,
    producer_id: int,
    epoch: int,
    base_seq: int,
    auto_create_queues: int,
    limits: Limits,
    step: int = YIELD_EVERY,
) -> bytes:
    """:func:`codec.encode_produce_rows`, its records encoded in slices of
    ``step`` with a yield to the event loop between them (the same bytes)."""
    codec.check_produce(topic, len(rows), producer_id, epoch, base_seq, auto_create_queues, limits)
    parts: list[bytes] = []
    for start in range(0, len(rows), step):
        parts += codec.encode_records(rows[start : start + step], limits, start)
        if start + step < len(rows):
            await asyncio.sleep(0)
    return codec.assemble_produce(
        topic,
        len(rows),
        parts,
        ts_ms,
        producer_id=producer_id,
        epoch=epoch,
        base_seq=base_seq,
        auto_create_queues=auto_create_queues,
        limits=limits,
    )


def parse_messages(raw_msgs: object, now: int | None = None, first: int = 0) -> list[MessageRow]:
    """The ``messages`` of a produce request, as the encoder's rows; raises
    InvalidArgument naming the first field at fault.

    Most messages are ``{"value": ...}`` with at most an ``encoding``: those
    take an inline path; anything else (or anything that path would refuse)
    goes through :func:`_parse_message`, which accepts and refuses exactly
    as before, so both paths agree on every input (tests/http/test_parse.py).
    A message without ``born_ts_ms`` is born at the request's arrival."""
    if not isinstance(raw_msgs, list) or not raw_msgs:
        raise InvalidArgument("messages must be a non-empty list", field="messages")
    if now is None:
        now = int(time.time() * 1000)
    out: list[MessageRow] = []
    add = out.append
    a2b = binascii.a2b_base64
    for k, m in enumerate(raw_msgs):
        if type(m) is dict and len(m) <= 2:
            value = m.get("value")
            if type(value) is str:
                # One key: it is "value". Two: the other must be "encoding".
                encoding = m.get("encoding") if len(m) == 2 else "base64"
                if encoding == "utf-8":
                    add((value.encode("utf-8"), "", (), (), None, None, now))
                    continue
                if encoding == "base64":
                    try:
                        body = a2b(value, strict_mode=True)
                    except ValueError:  # binascii.Error included: refused below
                        pass
                    else:
                        add((body, "", (), (), None, None, now))
                        continue
        add(_parse_message(m, first + k, now))
    return out


def _parse_message(m: object, k: int, now_ms: int) -> MessageRow:
    where = f"messages[{k}]"
    if not isinstance(m, dict):
        raise InvalidArgument("each message must be an object", field=where)
    value = m.get("value")
    encoding = m.get("encoding", "base64")
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}.value must be a string", field=f"{where}.value")
    if encoding == "base64":
        try:
            # what base64.b64decode(value, validate=True) does, without its wrapper
            body = binascii.a2b_base64(value, strict_mode=True)
        except ValueError:  # binascii.Error, or a str that is not ASCII
            raise InvalidArgument(
                f"{where}.value is not valid base64", field=f"{where}.value"
            ) from None
    elif encoding == "utf-8":
        body = value.encode("utf-8")
    else:
        raise InvalidArgument(
            f"{where}.encoding must be 'base64' or 'utf-8'", field=f"{where}.encoding"
        )
    keys_raw = m.get("keys", m.get("key"))
    if keys_raw is None:
        keys: tuple[str, ...] = ()
    elif isinstance(keys_raw, str):
        keys = (keys_raw,)
    elif isinstance(keys_raw, list) and all(isinstance(x, str) for x in keys_raw):
        keys = tuple(keys_raw)
    else:
        raise InvalidArgument(f"{where}.keys must be strings", field=f"{where}.keys")
    tags = m.get("tags", m.get("tag", ""))
    if isinstance(tags, list) and all(isinstance(x, str) for x in tags):
        tags = tags[0] if len(tags) == 1 else "||".join(tags)
    if not isinstance(tags, str):
        raise InvalidArgument(f"{where}.tags must be a string", field=f"{where}.tags")
    props = m.get("properties") or {}
    if not isinstance(props, dict) or not all(
        isinstance(a, str) and isinstance(b, str) for a, b in props.items()
    ):
        raise InvalidArgument(
            f"{where}.properties must map strings to strings", field=f"{where}.properties"
        )
    queue = m.get("queue")
    if queue is not None and (
        not isinstance(queue, int) or isinstance(queue, bool) or not 0 <= queue < codec.MAX_QUEUES
    ):
        raise InvalidArgument(
            f"{where}.queue must be an integer within 0..{codec.MAX_QUEUES - 1}",
            field=f"{where}.queue",
        )
    born = m.get("born_ts_ms", now_ms)
    if not isinstance(born, int) or isinstance(born, bool) or not 0 <= born < 1 << 62:
        raise InvalidArgument(f"{where}.born_ts_ms must be an integer", field=f"{where}.born_ts_ms")
    return (
        body,
        tags,
        keys,
        tuple(sorted(props.items())),
        queue,
        _str_field(m, "sharding_key", where) or None,
        born,
    )


def produce_json(res: ProduceResult) -> dict[str, Any]:
    acks, dup = res.acks, res.duplicate
    return {
        "topic": res.topic,
        "duplicate": res.duplicate,
        "store_ts_ms": res.store_ts_ms,
        "messages": [
            {
                "queue": q,
                "queue_offset": qoff,
                "commit_offset": phys,
                "size": size,
                "msg_id": msg_id,
                "duplicate": dup,
            }
            for (q, qoff, phys, size), msg_id in zip(acks.rows(), acks.msg_ids(), strict=True)
        ],
    }


def _topic_json(t: TopicInfo) -> dict[str, Any]:
    return {
        "name": t.name,
        "queues": [
            {"queue": q.queue, "min_offset": q.min_offset, "max_offset": q.max_offset}
            for q in t.queues
        ],
    }


def _offsets_json(r: OffsetsResult) -> dict[str, Any]:
    return {
        "group": r.group,
        "offsets": [{"topic": t, "queue": q, "offset": o} for t, q, o in r.offsets],
    }


def _message_json(m: StoredMessage, as_text: bool) -> dict[str, Any]:
    value: str
    encoding = "base64"
    if as_text:
        try:
            value, encoding = m.body.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            value = base64.b64encode(m.body).decode()
    else:
        value = base64.b64encode(m.body).decode()
    return {
        "queue_offset": m.queue_offset,
        "commit_offset": m.phys_offset,
        "size": m.size,
        "msg_id": m.msg_id,
        "store_ts_ms": m.store_ts_ms,
        "born_ts_ms": m.born_ts_ms,
        "tags": m.tag,
        "keys": list(m.keys),
        "properties": dict(m.properties),
        "value": value,
        "encoding": encoding,
    }


def _read_json(res: ReadResult, confirm_offset: int, as_text: bool) -> dict[str, Any]:
    return {
        "messages": [_message_json(m, as_text) for m in res.messages],
        "next_offset": res.next_offset,
        "min_offset": res.min_offset,
        "max_offset": res.max_offset,
        "confirm_offset": confirm_offset,
    }
