"""A broker node's part in a multi-group deployment (``group.toml`` next to
its cluster file; see :mod:`dledger_app.groups`).

- **Heartbeat.** Every node heartbeats to the controller once a second:
  alive, whether it is its group's ready leader, whether it knows a leader,
  its term, its group's address book and (a leader) the route version its
  group has applied. The controller decides liveness from these.
- **Reconcile.** When the controller's route-table version moves past what
  this node fetched, it fetches the table (``GET /v1/routes``). The group's
  leader then makes its own log agree: it creates (or grows) every topic
  of which the group owns a queue, with the topic's full queue count (queue
  numbers are the same in every group: a group simply never receives
  messages for queues it does not own), and deletes topics the controller
  deleted. Then it reports the version in its next heartbeat.
- **Routes.** ``GET /v1/routes`` and ``GET /v1/routes/{topic}`` answer
  from the table this node fetched last (with its version), so they keep
  answering while the controller is down.
- **Topic administration** (``POST /v1/topics``, ``PATCH`` / ``DELETE
  /v1/topics/{topic}``) is forwarded to the controller: route changes go
  through its log only. No controller leader: ``503 CONTROLLER_UNAVAILABLE``.
- **Ownership.** A produce whose messages name a queue this group does not
  own is refused with ``421 WRONG_GROUP`` naming the owner; messages
  without a queue or sharding key get one of the group's own queues (round
  robin; an idempotent batch one queue for the whole batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from broker_adapter import codec as broker_codec
from broker_adapter.codec import CommandKind
from broker_adapter.errors import BrokerError
from broker_adapter.node_sm import BrokerStateMachine
from controller.state import HEARTBEAT_INTERVAL_MS, route_from_table
from dledger.cmode.node import CmodeNode
from dledger.core.types import Role
from dledger.http_auth import RouteRole
from dledger.node import Node
from dledger_app.groups import GroupFile
from http_api.client import ApiError, AsyncClient, UnavailableError
from http_api.errors import (
    BATCH_REFUSED,
    UnsupportedMediaType,
    envelope,
    error_response,
    json_response,
)
from http_api.guard import JSON_BODY

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

FORWARD_RETRY_S = 5.0


class GroupAgent:
    def __init__(self, node: Node | CmodeNode, sm: BrokerStateMachine, gf: GroupFile) -> None:
        self.node = node
        self.sm = sm
        self.group = gf.name
        self.controller = list(gf.controller)
        self.table: dict[str, Any] | None = None
        self.reconciled = 0
        self.last_ok_ms = 0
        self.last_error = ""
        self._rr = 0
        self._task: asyncio.Task[None] | None = None
        self._hb: AsyncClient | None = None
        self._admin: AsyncClient | None = None

    # -- life cycle ---------------------------------------------------------------
    def start(self) -> None:
        # With auth on, the node heartbeats with an admin token of its own
        # cluster file (the controller's must accept it); forwarded topic
        # administration carries the caller's own token instead.
        auth = self.node.cfg.auth
        token = (auth.token_with("admin") if auth is not None else None) or ""
        # Short deadlines for the heartbeat: a missed one is simply sent again.
        self._hb = AsyncClient(self.controller, timeout_s=2.0, retry_for_s=1.0, token=token)
        self._admin = AsyncClient(
            self.controller, timeout_s=15.0, retry_for_s=FORWARD_RETRY_S, token=""
        )
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for c in (self._hb, self._admin):
            if c is not None:
                await c.close()

    async def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                msg = f"{type(exc).__name__}: {exc}"
                if msg != self.last_error:
                    logger.warning("controller heartbeat failed: %s", msg)
                self.last_error = msg
            delay = HEARTBEAT_INTERVAL_MS / 1000 - (time.monotonic() - t0)
            await asyncio.sleep(max(0.05, delay))

    # -- heartbeat and reconcile ---------------------------------------------------
    def _is_leader(self) -> bool:
        n = self.node
        return n.running and n.role is Role.LEADER and n.leader_ready()

    async def beat(self) -> None:
        assert self._hb is not None
        node = self.node
        if not node.running:
            return
        st = node.status()
        leader = self._is_leader()
        body = {
            "group": self.group,
            "node_id": node.cfg.node_id,
            "http": f"{node.cfg.http_host}:{node.cfg.http_port}",
            "leader": leader,
            "term": int(st.get("term", 0)),
            "knows_leader": node.leader != 0,
            "members": [[m.id, m.http_address] for m in node.cfg.members],
            "routes_version": self.reconciled if leader else 0,
        }
        cm = node if isinstance(node, CmodeNode) else None  # controller mode
        if cm is not None:
            body["replica"] = cm.replica_info()
            body["term"] = cm.epoch
        res = await self._hb.request("POST", "/v1/heartbeat", body, safe=True)
        if cm is not None:
            await self._cmode(cm, res)
        self.last_ok_ms = int(time.time() * 1000)
        if self.last_error:
            logger.info("controller heartbeat answered again")
            self.last_error = ""
        version = int(res.get("version", 0))
        if self.table is None or version > int(self.table.get("version", 0)):
            self.table = await self._hb.request("GET", "/v1/routes", safe=True)
        if leader and self.table is not None and self.reconciled < int(self.table["version"]):
            await self.reconcile(self.table)

    async def _cmode(self, cm: CmodeNode, res: dict[str, Any]) -> None:
        """Controller mode: take the controller's word (master, epoch,
        SyncStateSet), then, as master, ask for the SyncStateSet change the
        master's rules want (the controller checks the epochs)."""
        rep = res.get("replica")
        if not isinstance(rep, dict):
            return
        cm.assign(
            int(rep["master"]),
            int(rep["epoch"]),
            frozenset(int(i) for i in rep["sync_state_set"]),
            int(rep["sync_state_set_epoch"]),
        )
        req = cm.poll_alter_request()
        if req is None:
            return
        assert self._hb is not None
        body = {
            "master": cm.cfg.node_id,
            "epoch": req.epoch,
            "sync_state_set_epoch": req.sync_state_set_epoch,
            "new_set": sorted(req.new_set),
        }
        try:
            out = await self._hb.request(
                "POST", f"/v1/brokers/{self.group}/sync-state-set", body, safe=False
            )
        except (ApiError, UnavailableError) as exc:
            logger.info("SyncStateSet change %s not made: %s", sorted(req.new_set), exc)
            cm.alter_failed()
            return
        logger.info("SyncStateSet now %s (%s)", out.get("sync_state_set"), req.reason)
        cm.assign(
            int(out["master"]),
            int(out["epoch"]),
            frozenset(int(i) for i in out["sync_state_set"]),
            int(out["sync_state_set_epoch"]),
        )

    async def reconcile(self, table: dict[str, Any]) -> None:
        """Make this group's log hold the queues the table gives it (leader only)."""
        broker = self.sm.broker
        ok = True
        now = int(time.time() * 1000)
        for topic, r in sorted(table.get("topics", {}).items()):
            queues: list[str] = r["queues"]
            if self.group not in queues:
                continue
            if not broker.has_topic(topic):
                data = broker_codec.encode_topic(CommandKind.CREATE_TOPIC, topic, now, len(queues))
            elif len(broker.topic(topic).queues) < len(queues):
                data = broker_codec.encode_topic(CommandKind.UPDATE_TOPIC, topic, now, len(queues))
            else:
                continue
            ok &= await self._apply(data, f"create {topic} ({len(queues)} queues)")
        for topic in sorted(table.get("deleted", {})):
            if topic not in table.get("topics", {}) and broker.has_topic(topic):
                data = broker_codec.encode_topic(CommandKind.DELETE_TOPIC, topic, now)
                ok &= await self._apply(data, f"delete {topic}")
        if ok:
            self.reconciled = int(table["version"])

    async def _apply(self, data: bytes, what: str) -> bool:
        try:
            async with asyncio.timeout(5.0):
                applied = await self.node.propose_entry(data)
        except Exception as exc:
            logger.warning("route reconcile: %s not applied: %s", what, exc)
            return False
        if isinstance(applied.result, BrokerError) and applied.result.code not in (
            "TOPIC_EXISTS",
            "UNKNOWN_TOPIC",
        ):
            logger.warning("route reconcile: %s refused: %s", what, applied.result)
            return False
        logger.info("route reconcile: %s", what)
        return True

    # -- HTTP -----------------------------------------------------------------------
    # the role each route needs when the cluster file turns auth on
    ROUTE_ROLES: dict[tuple[str, str], RouteRole] = {
        ("GET", "/v1/routes"): "any",
        ("GET", "/v1/routes/{topic}"): "any",
    }

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/routes", self.get_table),
            web.get("/v1/routes/{topic}", self.get_route),
        ]

    async def get_table(self, request: web.Request) -> web.Response:
        if self.table is None:
            return envelope(
                503, "CONTROLLER_UNAVAILABLE", "this node has not fetched the route table yet"
            )
        return json_response({**self.table, "from": "cache"})

    async def get_route(self, request: web.Request) -> web.Response:
        topic = request.match_info["topic"]
        r = route_from_table(self.table, topic) if self.table is not None else None
        if r is not None:
            return json_response(r)
        assert self._hb is not None
        try:  # maybe created since the last fetch
            fresh = await self._hb.request("GET", f"/v1/routes/{topic}", safe=True)
            return json_response(fresh)
        except ApiError as exc:
            return self._forward_error(exc)

    @staticmethod
    def _forward_error(exc: ApiError) -> web.Response:
        if isinstance(exc, UnavailableError) or exc.status in (0, 503):
            return envelope(
                503,
                "CONTROLLER_UNAVAILABLE",
                "the controller group cannot be reached or has no leader: route changes "
                f"are not possible now (produce and consume go on) ({exc})",
            )
        return envelope(exc.status, exc.code, str(exc).split(": ", 1)[-1], **exc.details)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path, method = request.path, request.method
        if path.startswith("/v1/topics"):
            parts = path.split("/")  # ['', 'v1', 'topics', topic?, ...]
            if (method == "POST" and len(parts) == 3) or (
                method in ("PATCH", "DELETE") and len(parts) == 4
            ):
                return await self._forward(request)
            if method == "POST" and len(parts) == 5 and parts[4] == "messages":
                refused = self._route_produce(request, parts[3])
                if refused is not None:
                    return refused
        return await handler(request)

    async def _forward(self, request: web.Request) -> web.Response:
        body = request.get(JSON_BODY)
        if body is None and request.can_read_body:
            raw = await request.read()
            body = orjson.loads(raw) if raw else None
        assert self._admin is not None
        headers = {}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        try:
            res = await self._admin.request(
                request.method, request.path_qs, body, safe=False, headers=headers
            )
        except ApiError as exc:
            return self._forward_error(exc)
        return json_response(res, 201 if request.method == "POST" else 200)

    def _route_produce(self, request: web.Request, topic: str) -> web.Response | None:
        if request.content_type == broker_codec.BATCH_CONTENT_TYPE:
            return error_response(UnsupportedMediaType(BATCH_REFUSED))
        body = request.get(JSON_BODY)
        return self.route_produce_body(topic, body) if isinstance(body, dict) else None

    def route_produce_body(self, topic: str, body: dict[str, Any]) -> web.Response | None:
        """A checked produce body to ``topic``: 421 WRONG_GROUP when a message
        names (or its sharding key hashes to) another group's queue; queues
        of this group filled in for messages that name none. None: go on.
        The middleware's produce step, and the express lane's hook for it
        (http_api.server.PRODUCE_HOOKS)."""
        if self.table is None:
            return None
        r = route_from_table(self.table, topic)
        if r is None:
            return None
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        owners = [q["group"] for q in r["queues"]]
        n = len(owners)
        mine = [q for q, g in enumerate(owners) if g == self.group]
        idem_queue: int | None = None
        pid = body.get("producer_id")
        for k, m in enumerate(msgs):
            if not isinstance(m, dict):
                return None  # the handler refuses it, naming the field
            q = m.get("queue")
            key = m.get("sharding_key")
            if q is None and isinstance(key, str) and key:
                # the route's queue count, not this group's copy of it (which
                # lags while the group reconciles a grown topic)
                q = m["queue"] = zlib.crc32(key.encode("utf-8")) % n
            if q is None:
                if not mine:
                    return self._wrong(r, topic, 0, k)
                if pid is not None:
                    if idem_queue is None:
                        idem_queue = mine[zlib.crc32(str(pid).encode()) % len(mine)]
                    m["queue"] = idem_queue
                else:
                    self._rr += 1
                    m["queue"] = mine[self._rr % len(mine)]
                continue
            if isinstance(q, int) and 0 <= q < n and owners[q] != self.group:
                return self._wrong(r, topic, q, k)
        return None

    def _wrong(self, r: dict[str, Any], topic: str, q: int, k: int) -> web.Response:
        owner = r["queues"][q]["group"] if r["queues"] else None
        info = r["groups"].get(owner, {}) if owner else {}
        return envelope(
            421,
            "WRONG_GROUP",
            f"queue {q} of topic {topic!r} belongs to broker group {owner!r}, not "
            f"{self.group!r} (route version {r['version']}); send it there, or through "
            "the proxy or a routing client",
            field=f"messages[{k}].queue",
            group=owner,
            leader_http=info.get("leader_http"),
            version=r["version"],
        )
