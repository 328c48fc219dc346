"""A controller node: the dledger node runtime with the controller's state
machine (:mod:`controller.state`) and its HTTP API.

Routes (JSON), next to the operator routes (``/raft/*``, ``/healthz``)::

    POST   /v1/heartbeat            a broker node's heartbeat (leader only: 307 elsewhere)
    GET    /v1/routes               the whole route table with its version
    GET    /v1/routes/{topic}       one topic's route with its version
    GET    /v1/brokers              broker groups, members, liveness
    POST   /v1/topics               create {name, queues}: placed over the live groups
    GET    /v1/topics               the topics and their routes
    GET    /v1/topics/{topic}       = /v1/routes/{topic}
    PATCH  /v1/topics/{topic}       grow {queues}
    DELETE /v1/topics/{topic}       delete
    GET    /readyz                  200 when a leader is known and this node caught up

Route changes go through the controller's log; reads answer from this
node's applied state (every replica answers the same for the same applied
index; the version says how fresh). A route change answers once the owning
groups' leaders report (in their heartbeats) that they applied it, or after
``apply_wait_s`` with the groups still ``pending`` (they catch up on their
next heartbeat: nothing is lost by answering early).

The leader proposes a ``tick`` with its clock every second, so liveness
moves on even when no broker heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson
from aiohttp import web

from broker_adapter import codec as broker_codec
from broker_adapter.errors import BrokerError, InvalidArgument
from controller import codec
from controller.node_sm import ControllerStateMachine
from controller.state import HEARTBEAT_INTERVAL_MS, NoLiveGroup
from dledger.admin_http import AdminServer, make_app
from dledger.core.types import Role
from dledger.errors import NotLeader
from dledger.http_auth import ROUTE_ROLES as APP_ROUTE_ROLES
from dledger.http_auth import RouteRole
from dledger.node import Node, OutcomeUnknown
from http_api.errors import envelope, error_response, json_response

logger = logging.getLogger(__name__)

APPLY_WAIT_S = 5.0


def now_ms() -> int:
    return int(time.time() * 1000)


def _int_field(
    body: dict[str, Any], name: str, lo: int, hi: int, default: int | None = None
) -> int:
    v = body.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise InvalidArgument(f"{name} must be an integer within {lo}..{hi}", field=name)
    return v


# The role each route needs when the cluster file turns auth on
# (dledger.http_auth; routes not listed need "admin").
ROUTE_ROLES: dict[tuple[str, str], RouteRole] = {
    ("POST", "/v1/heartbeat"): "admin",
    ("POST", "/v1/brokers/{group}/sync-state-set"): "admin",
    ("GET", "/v1/routes"): "any",
    ("GET", "/v1/routes/{topic}"): "any",
    ("GET", "/v1/brokers"): "any",
    ("POST", "/v1/topics"): "admin",
    ("GET", "/v1/topics"): "any",
    ("GET", "/v1/topics/{topic}"): "any",
    ("PATCH", "/v1/topics/{topic}"): "admin",
    ("DELETE", "/v1/topics/{topic}"): "admin",
    ("GET", "/v1/cluster"): "admin",
    ("GET", "/readyz"): "any",
}


class ControllerApi:
    def __init__(self, node: Node, sm: ControllerStateMachine) -> None:
        self.node = node
        self.sm = sm
        self._changed = asyncio.Event()
        sm.add_listener(self._on_apply)
        self._ticker: asyncio.Task[None] | None = None

    def _on_apply(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def routes(self) -> list[web.RouteDef]:
        g = self._guard
        return [
            web.post("/v1/heartbeat", g(self.heartbeat)),
            web.post("/v1/brokers/{group}/sync-state-set", g(self.alter_sync_state_set)),
            web.get("/v1/routes", g(self.table)),
            web.get("/v1/routes/{topic}", g(self.route)),
            web.get("/v1/brokers", g(self.brokers)),
            web.post("/v1/topics", g(self.create_topic)),
            web.get("/v1/topics", g(self.list_topics)),
            web.get("/v1/topics/{topic}", g(self.route)),
            web.patch("/v1/topics/{topic}", g(self.update_topic)),
            web.delete("/v1/topics/{topic}", g(self.delete_topic)),
            web.get("/v1/cluster", g(self.cluster)),
            web.get("/readyz", g(self.readyz)),
        ]

    def _guard(self, fn: Any) -> Any:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                resp: web.StreamResponse = await fn(request)
                return resp
            except NotLeader as exc:
                leader_http = (
                    self.node.http_address_of(exc.leader_hint) if exc.leader_hint else None
                )
                if leader_http and exc.leader_hint != self.node.cfg.node_id:
                    return json_response(
                        {
                            "error": {
                                "code": "NOT_LEADER",
                                "message": str(exc),
                                "leader": exc.leader_hint,
                                "leader_http": leader_http,
                            }
                        },
                        307,
                        {"Location": f"http://{leader_http}{request.path_qs}"},
                    )
                return envelope(
                    503,
                    "CONTROLLER_UNAVAILABLE",
                    "the controller group has no leader: route changes and heartbeats wait "
                    "for one (produce and consume go on with cached routes)",
                    leader=None,
                )
            except NoLiveGroup as exc:
                return envelope(503, exc.code, str(exc))
            except Exception as exc:
                resp = error_response(exc)
                if resp.status == 500:
                    logger.exception("unhandled error serving %s %s", request.method, request.path)
                return resp

        return wrapped

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            return {}
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise InvalidArgument("the body is not JSON", field="body") from None
        if not isinstance(body, dict):
            raise InvalidArgument("the body must be a JSON object", field="body")
        return body

    async def _propose(self, data: bytes, timeout_s: float = 10.0) -> Any:
        node = self.node
        if node.role is not Role.LEADER or not node.leader_ready():
            raise NotLeader(node.leader if node.leader != node.cfg.node_id else 0)
        try:
            async with asyncio.timeout(timeout_s):
                applied = await node.propose_entry(data)
        except TimeoutError:
            raise OutcomeUnknown(f"not applied within {timeout_s:.0f} s; it may still") from None
        if isinstance(applied.result, BrokerError):
            raise applied.result
        return applied.result

    # -- leader clock -------------------------------------------------------------
    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_MS / 1000)
            node = self.node
            if node.running and node.role is Role.LEADER and node.leader_ready():
                try:
                    await self._propose(codec.tick(now_ms()), timeout_s=5.0)
                except Exception as exc:  # the next tick tries again
                    logger.debug("tick not applied: %s", exc)

    # -- handlers ------------------------------------------------------------------
    async def heartbeat(self, request: web.Request) -> web.Response:
        b = await self._body(request)
        members = b.get("members", [])
        if not isinstance(members, list) or not all(
            isinstance(m, list) and len(m) == 2 and isinstance(m[0], int) and isinstance(m[1], str)
            for m in members
        ):
            raise InvalidArgument("members must be [[id, host:port], ...]", field="members")
        http = b.get("http")
        if not isinstance(http, str):
            raise InvalidArgument("http must be host:port", field="http")
        replica = b.get("replica")
        if replica is not None:
            if not isinstance(replica, dict):
                raise InvalidArgument("replica must be an object", field="replica")
            replica = {
                "epoch": _int_field(replica, "epoch", 0, 1 << 62),
                "max_offset": _int_field(replica, "max_offset", 0, 1 << 62),
                "unclean": bool(replica.get("unclean", False)),
            }
        data = codec.heartbeat(
            now_ms(),
            broker_codec.check_name(b.get("group"), "group"),
            _int_field(b, "node_id", 1, 1 << 31),
            http,
            leader=bool(b.get("leader")),
            term=_int_field(b, "term", 0, 1 << 62),
            knows_leader=bool(b.get("knows_leader", True)),
            members=[(int(i), str(a)) for i, a in members],
            routes_version=_int_field(b, "routes_version", 0, 1 << 62, 0),
            replica=replica,
        )
        res = await self._propose(data, timeout_s=3.0)
        return json_response(res)

    async def alter_sync_state_set(self, request: web.Request) -> web.Response:
        """A controller-mode master asks for a new SyncStateSet (409
        STALE_EPOCH when it is no longer the master, or the set moved on)."""
        b = await self._body(request)
        new_set = b.get("new_set")
        if not isinstance(new_set, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in new_set
        ):
            raise InvalidArgument("new_set must be a list of node ids", field="new_set")
        data = codec.alter_sync_state_set(
            now_ms(),
            broker_codec.check_name(request.match_info["group"], "group"),
            _int_field(b, "master", 1, 1 << 31),
            _int_field(b, "epoch", 1, 1 << 62),
            _int_field(b, "sync_state_set_epoch", 0, 1 << 62),
            new_set,
        )
        return json_response(await self._propose(data, timeout_s=3.0))

    async def _read(self) -> None:
        await self.node.read("committed")

    async def table(self, request: web.Request) -> web.Response:
        await self._read()
        return json_response(self.sm.state.table())

    async def route(self, request: web.Request) -> web.Response:
        await self._read()
        return json_response(self.sm.state.route(request.match_info["topic"]))

    async def brokers(self, request: web.Request) -> web.Response:
        await self._read()
        st = self.sm.state
        return json_response(
            {
                "version": st.version,
                "now_ms": st.now_ms,
                "groups": [st.group_json(n) for n in sorted(st.groups)],
            }
        )

    async def list_topics(self, request: web.Request) -> web.Response:
        await self._read()
        st = self.sm.state
        return json_response({"topics": [st.route(t) for t in sorted(st.routes)]})

    async def _wait_groups(self, groups: list[str], version: int) -> list[str]:
        """The groups (of ``groups``) whose leaders have not reported
        applying route version ``version`` within APPLY_WAIT_S."""
        deadline = time.monotonic() + APPLY_WAIT_S
        while True:
            st = self.sm.state
            pending = [
                g
                for g in groups
                if g in st.groups and st.groups[g].routes_version < version and st.group_live(g)
            ]
            if not pending or time.monotonic() >= deadline:
                return pending
            ev = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await ev.wait()

    async def create_topic(self, request: web.Request) -> web.Response:
        b = await self._body(request)
        name = broker_codec.check_name(b.get("name"))
        queues = broker_codec.check_queue_count(b.get("queues", 8))
        route = await self._propose(codec.create_topic(now_ms(), name, queues))
        pending = await self._wait_groups(sorted(route["groups"]), route["version"])
        return json_response({**route, "pending_groups": pending}, 201)

    async def update_topic(self, request: web.Request) -> web.Response:
        b = await self._body(request)
        name = broker_codec.check_name(request.match_info["topic"])
        queues = broker_codec.check_queue_count(b.get("queues"))
        route = await self._propose(codec.update_topic(now_ms(), name, queues))
        pending = await self._wait_groups(sorted(route["groups"]), route["version"])
        return json_response({**route, "pending_groups": pending})

    async def delete_topic(self, request: web.Request) -> web.Response:
        name = broker_codec.check_name(request.match_info["topic"])
        res = await self._propose(codec.delete_topic(now_ms(), name))
        pending = await self._wait_groups(res["groups"], res["version"])
        return json_response({**res, "pending_groups": pending})

    async def cluster(self, request: web.Request) -> web.Response:
        st = self.node.status()
        cs = self.sm.state
        st["controller"] = {
            "version": cs.version,
            "now_ms": cs.now_ms,
            "topics": len(cs.routes),
            "groups": {n: cs.group_live(n) for n in sorted(cs.groups)},
        }
        return json_response(st)

    async def readyz(self, request: web.Request) -> web.Response:
        node = self.node
        st = node.status() if node.running else {}
        lag = int(st.get("commit", 0)) - int(st.get("applied", 0))
        ok = node.running and node.leader != 0 and lag <= 0
        body = {"ready": ok, "role": node.role.name.lower(), "leader": node.leader, "lag": lag}
        if not ok:
            return envelope(503, "NOT_READY", "no leader known, not running or lagging", **body)
        return json_response(body)


class ControllerServer(AdminServer):
    """The operator routes plus :class:`ControllerApi` on the node's HTTP address."""

    def __init__(self, node: Node) -> None:
        assert isinstance(node.state_machine, ControllerStateMachine)
        self.api = ControllerApi(node, node.state_machine)
        app = make_app(node)
        app.router.add_routes(self.api.routes())
        app[APP_ROUTE_ROLES].update(ROUTE_ROLES)
        super().__init__(node, app)

    async def start(self) -> None:
        await super().start()
        self.api.start()

    async def stop(self) -> None:
        await self.api.stop()
        await super().stop()
