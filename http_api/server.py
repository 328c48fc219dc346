"""Serving a node: the admin app (``/raft/*``, ``/healthz``) plus the /v1
broker API on one aiohttp application at the node's HTTP address."""

from __future__ import annotations

import functools
import os
from typing import Any

from aiohttp import web

from broker_adapter.bodies import Bodies, DurableBodies, LmdbBodies
from broker_adapter.node_sm import BrokerStateMachine
from dledger.admin_http import AdminServer, make_app
from dledger.config import NodeConfig
from dledger.http_auth import ROUTE_ROLES
from dledger.node import Node
from dledger.statemachine import LogStateMachine, StateMachine
from http_api.app import ROUTE_ROLES as API_ROUTE_ROLES
from http_api.app import BrokerApi
from http_api.guard import GUARD_KEY, Guard, HttpLimits
from http_api.protocol import Express, NodeAppRunner

API_KEY = web.AppKey("broker_api", BrokerApi)
# the middlewares make_node_app installs; the express lane answers as they do
STANDARD_MIDDLEWARES = web.AppKey("standard_middlewares", tuple)
# A composition that appends a middleware acting on produce requests (a
# broker group's agent routes them) registers here, per middleware, what it
# does to a checked produce body (ProduceHook: an error answer, or None to go
# on, possibly after changing the body); the express lane then runs the same
# hooks in the same order instead of giving way.
PRODUCE_HOOKS = web.AppKey("produce_hooks", dict)


# The listen backlog: a burst of connects beyond it waits in SYN_RECV for
# SYN-ACK retransmits (seconds), unseen by the node's timeouts.
BACKLOG = 1024


def make_state_machine(cfg: NodeConfig) -> StateMachine:
    """What ``cfg.state_machine`` names; the broker keeps the replica records
    ``/raft/applied`` needs (it is a LogStateMachine)."""
    if cfg.state_machine == "log":
        return LogStateMachine()
    if cfg.replication == "controller":
        # Controller mode rebuilds its state at start and after a truncation:
        # records in a store of their own next to the log.
        bodies: Bodies = LmdbBodies(os.path.join(cfg.data_dir, "broker-bodies"))
    else:
        # Message records and the ConsumeQueue live in the log's own LMDB
        # environment, checkpointed in its group commits: memory holds only
        # the metadata, and a restart reads the state back instead of
        # rebuilding it.
        bodies = DurableBodies()
    return BrokerStateMachine(broker_name=cfg.cluster_id, bodies=bodies)


def make_node_app(node: Node) -> web.Application:
    """The node's application; every route passes the HTTP guard
    (:mod:`http_api.guard`): caps, strict parameters and bodies."""
    app = make_app(node)
    guard = Guard(HttpLimits.of(node.cfg))
    app[GUARD_KEY] = guard
    app.on_cleanup.append(guard.on_cleanup)
    # edge: before the error and auth middlewares (repeated Authorization,
    # declared size, encoding); strict: innermost, after authentication.
    app.middlewares.insert(0, guard.edge)
    app.middlewares.append(guard.strict)
    sm = node.state_machine
    if isinstance(sm, BrokerStateMachine):
        api = BrokerApi(node, sm, node.cfg.auto_create_topic_queues)
        app[API_KEY] = api
        app.router.add_routes(api.routes())
        app[ROUTE_ROLES].update(API_ROUTE_ROLES)
        app.middlewares.insert(0, api.observe)  # outermost: sees every answer
    app[STANDARD_MIDDLEWARES] = tuple(app.middlewares)
    return app


def express_of(node: Node, app: web.Application) -> Express | None:
    """What answers the express lane's produce requests on ``app``
    (:mod:`http_api.protocol`): none without the broker API, with
    ``http_express = false``, with bearer-token auth (which the lane does
    not check), or when a composition added a middleware to the app that
    did not register its :data:`PRODUCE_HOOKS` entry (the lane would skip
    it). Ask once the app is composed."""
    api = app.get(API_KEY)
    guard = app.get(GUARD_KEY)
    if not node.cfg.http_express or node.cfg.auth is not None or api is None or guard is None:
        return None
    standard: tuple[Any, ...] = app.get(STANDARD_MIDDLEWARES, ())
    mws = tuple(app.middlewares)
    if mws[: len(standard)] != standard:
        return None  # a composition put one before or between ours
    known = app.get(PRODUCE_HOOKS, {})
    extra = mws[len(standard) :]
    if any(mw not in known for mw in extra):
        return None
    return functools.partial(api.produce_express, guard, tuple(known[mw] for mw in extra))


class NodeServer(AdminServer):
    """Serves :func:`make_node_app` (operator routes plus /v1) on the node's http address."""

    def __init__(self, node: Node, app: web.Application | None = None) -> None:
        """``app``: one :func:`make_node_app` made (and a composition extended)."""
        app = app if app is not None else make_node_app(node)
        super().__init__(node, app)
        # the node's connection limits (timeouts, connection cap, envelope
        # answers of the HTTP parser): http_api/protocol.py
        self._runner = self._node_runner = NodeAppRunner(
            app, HttpLimits.of(node.cfg), access_log=None, shutdown_timeout=2.0
        )
        self._app = app

    async def start(self) -> None:
        self._node_runner.express = express_of(self.node, self._app)  # composed by now
        await self._runner.setup()
        backlog = min(BACKLOG, self.node.cfg.http_max_connections)
        site = web.TCPSite(
            self._runner,
            self.node.cfg.http_host,
            self.node.cfg.http_port,
            reuse_address=True,
            backlog=max(128, backlog),
        )
        await site.start()
