"""One node serving the whole HTTP app in-process, for aiohttp's TestClient."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from aiohttp.web_runner import BaseRunner

from dledger.config import NodeConfig
from dledger.node import Node
from http_api.guard import HttpLimits
from http_api.protocol import NodeAppRunner
from http_api.server import make_node_app, make_state_machine


class NodeTestServer(TestServer):
    """aiohttp's TestServer with the node's connection handling
    (http_api/protocol.py: limits, timeouts, envelope parser errors)."""

    def __init__(self, app: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        return NodeAppRunner(self.app, self.limits, **kwargs)


@asynccontextmanager
async def serve_one_node(cfg: NodeConfig) -> AsyncIterator[TestClient[Any, Any]]:
    """Start a one-voter node from ``cfg``, wait until it leads, serve its app."""
    node = Node(cfg, make_state_machine(cfg))
    await node.start()
    deadline = time.monotonic() + 10
    while not node.leader_ready():
        assert time.monotonic() < deadline, "a one-node cluster did not elect itself"
        await asyncio.sleep(0.02)
    server = NodeTestServer(make_node_app(node), HttpLimits.of(cfg))
    c: TestClient[Any, Any] = TestClient(server)
    await c.start_server()
    try:
        yield c
    finally:
        await c.close()
        await node.stop()
