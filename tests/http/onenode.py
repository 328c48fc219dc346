"""One node serving the whole HTTP app in-process, for aiohttp's TestClient."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.web_runner import BaseRunner

from dledger.cluster import free_ports
from dledger.config import NodeConfig
from dledger.node import Node
from http_api.guard import HttpLimits
from http_api.protocol import Express, NodeAppRunner
from http_api.server import BACKLOG, express_of, make_node_app, make_state_machine


class _WideBacklog(socket.socket):
    """A listening socket whose backlog is at least the node's (asyncio
    listens with aiohttp's 128: a burst of connects would wait in SYN_RECV)."""

    backlog = BACKLOG

    def listen(self, backlog: int = 0, /) -> None:
        super().listen(max(backlog, self.backlog))


def _wide_backlog_socket(host: str, port: int, family: socket.AddressFamily) -> socket.socket:
    s = _WideBacklog(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    return s


class NodeTestServer(TestServer):
    """aiohttp's TestServer with the node's connection handling
    (http_api/protocol.py: limits, timeouts, envelope parser errors) and
    listen backlog (http_api/server.py)."""

    def __init__(
        self, app: Any, limits: HttpLimits, express: Express | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("socket_factory", _wide_backlog_socket)
        super().__init__(app, **kwargs)
        self.limits = limits
        self.express = express

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        return NodeAppRunner(self.app, self.limits, self.express, **kwargs)


def one_node_config(tmp_path: Path, cluster_id: str, **kw: Any) -> NodeConfig:
    """A one-voter node's config on free loopback ports, its data under
    ``tmp_path``; ``kw`` sets any other field."""
    raft_port, http_port = free_ports(2)
    return NodeConfig(
        node_id=1,
        cluster_id=cluster_id,
        raft_host="127.0.0.1",
        raft_port=raft_port,
        http_host="127.0.0.1",
        http_port=http_port,
        data_dir=str(tmp_path / "n1"),
        **kw,
    )


@asynccontextmanager
async def serve_one_node(
    cfg: NodeConfig, compose: Callable[[web.Application], None] | None = None
) -> AsyncIterator[TestClient[Any, Any]]:
    """Start a one-voter node from ``cfg``, wait until it leads, serve its app
    (after ``compose`` extended it, as a broker group's agent does)."""
    node = Node(cfg, make_state_machine(cfg))
    await node.start()
    deadline = time.monotonic() + 10
    while not node.leader_ready():
        assert time.monotonic() < deadline, "a one-node cluster did not elect itself"
        await asyncio.sleep(0.02)
    app = make_node_app(node)
    if compose is not None:
        compose(app)
    server = NodeTestServer(app, HttpLimits.of(cfg), express_of(node, app))
    c: TestClient[Any, Any] = TestClient(server)
    await c.start_server()
    try:
        yield c
    finally:
        await c.close()
        await node.stop()
