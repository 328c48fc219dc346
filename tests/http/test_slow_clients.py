"""500 idle, slowloris (a header byte now and then) and partial-body
connections are all closed by the node within its documented timeouts
(``http_header_timeout_ms``, ``http_body_timeout_ms``), while a normal
client keeps being served. One node in-process, with the node's own
connection handling (http_api/protocol.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient

from dledger.config import NodeConfig
from tests.http.onenode import serve_one_node

HEADER_MS = 1500
BODY_MS = 1500
LINGER_S = 2.0  # what the node reads and drops after answering an unread body
CONNECT_S = 30.0  # connects that overflow the listen backlog wait for SYN retries
SLACK_S = 10.0  # a loaded 2-core machine: scheduling, not the property under test


# Each connection's life, from when the client's connect returned (a burst of
# 500 overflows the listen backlog: some connects wait for SYN retries) to
# EOF, by kind.
Lives = dict[str, list[float]]


async def _idle(port: int, closed: list[float], lives: Lives) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    with contextlib.suppress(ConnectionError):
        await reader.read()  # EOF (or an answer then EOF) when the node closes
    closed.append(time.monotonic())
    lives.setdefault("idle", []).append(closed[-1] - t0)
    writer.close()


async def _slowloris(port: int, closed: list[float], lives: Lives) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(b"GET /v1/topics HTTP/1.1\r\nHost: x\r\n")
    eof = asyncio.ensure_future(reader.read())
    try:
        while not eof.done():
            writer.write(b"X")  # never the end of the header
            await asyncio.wait([eof], timeout=0.2)
    except ConnectionError:
        pass
    with contextlib.suppress(ConnectionError):
        await eof
    closed.append(time.monotonic())
    lives.setdefault("slowloris", []).append(closed[-1] - t0)
    writer.close()


async def _partial_body(port: int, closed: list[float], answers: list[bytes], lives: Lives) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(
        b"POST /v1/topics/t/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"messages": ['
    )
    try:
        answers.append(await reader.read())
    except ConnectionError:
        answers.append(b"")
    closed.append(time.monotonic())
    lives.setdefault("partial body", []).append(closed[-1] - t0)
    writer.close()


async def test_idle_and_slow_connections_are_closed_in_time(tmp_path: Path) -> None:
    cfg = NodeConfig(
        node_id=1,
        cluster_id="slow",
        raft_host="127.0.0.1",
        raft_port=1,
        http_host="127.0.0.1",
        http_port=2,
        data_dir=str(tmp_path / "n1"),
        http_header_timeout_ms=HEADER_MS,
        http_body_timeout_ms=BODY_MS,
        http_idle_timeout_ms=HEADER_MS,
    )
    async with serve_one_node(cfg) as c:
        assert (await c.post("/v1/topics", json={"name": "t"})).status == 201
        port = c.server.port
        assert port is not None
        closed: list[float] = []
        answers: list[bytes] = []
        t0 = time.monotonic()
        lives: Lives = {}
        tasks = [asyncio.ensure_future(_idle(port, closed, lives)) for _ in range(200)]
        tasks += [asyncio.ensure_future(_slowloris(port, closed, lives)) for _ in range(200)]
        tasks += [
            asyncio.ensure_future(_partial_body(port, closed, answers, lives)) for _ in range(100)
        ]
        served = 0
        statuses: list[int] = []
        deadline = t0 + (HEADER_MS + BODY_MS) / 1000 + LINGER_S + CONNECT_S + SLACK_S
        while len(closed) < len(tasks) and time.monotonic() < deadline:
            r = await _served(c)
            statuses.append(r)
            served += r == 200
            await asyncio.sleep(0.05)
        if len(closed) != len(tasks):
            kinds = ["idle"] * 200 + ["slowloris"] * 200 + ["partial body"] * 100
            open_ = sorted({k for k, t in zip(kinds, tasks, strict=True) if not t.done()})
            raise AssertionError(f"{len(closed)} of {len(tasks)} closed in time; open: {open_}")
        for t in tasks:
            await t
        # each within its documented timeout (plus scheduling slack)
        limits = {"idle": HEADER_MS / 1000, "slowloris": HEADER_MS / 1000,
                  "partial body": (HEADER_MS + BODY_MS) / 1000 + LINGER_S}  # fmt: skip
        for kind, limit in limits.items():
            assert max(lives[kind]) < limit + SLACK_S, (kind, max(lives[kind]))
            assert min(lives[kind]) >= limit * 0.5 - LINGER_S, (kind, min(lives[kind]))
        assert served >= 1 and set(statuses) == {200}, statuses
        # a partial body is answered 408 in the envelope (or the connection closed)
        timed_out = [a for a in answers if b" 408 " in a.split(b"\r\n", 1)[0]]
        assert len(timed_out) >= len(answers) // 2, answers[:3]
        assert all(b'"REQUEST_TIMEOUT"' in a for a in timed_out)
        # and the node still serves new connections normally
        assert await _served(c) == 200


async def _served(c: TestClient[Any, Any]) -> int:
    r = await c.get("/v1/topics")
    await r.read()
    return r.status
