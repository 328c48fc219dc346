"""The benchmarks' HTTP load generators: the lean client frames responses
the way HTTP/1.1 does (Content-Length, chunked, Connection: close), counts
every outcome the way the aiohttp client does, and fails a request that
gets no answer instead of hanging."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from benchmarks import loadgen
from benchmarks.loadgen import ResponseError, closed_loop, open_loop, parse_response


def test_content_length_framing() -> None:
    wire = b"HTTP/1.1 200 OK\r\nContent-Type: x\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 503"
    assert parse_response(bytearray(wire)) == (200, len(wire) - len(b"HTTP/1.1 503"), True)
    for cut in range(len(wire) - 17):  # any prefix of the first response is incomplete
        assert parse_response(bytearray(wire[:cut])) is None, cut


def test_chunked_framing_with_and_without_trailers() -> None:
    body = b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n"
    plain = body + b"\r\n"
    assert parse_response(bytearray(plain + b"NEXT")) == (201, len(plain), True)
    trailers = body + b"Trailer-A: 1\r\n\r\n"
    assert parse_response(bytearray(trailers)) == (201, len(trailers), True)
    for cut in range(len(plain)):
        assert parse_response(bytearray(plain[:cut])) is None, cut


def test_close_no_body_and_garbage() -> None:
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    assert parse_response(bytearray(closing)) == (200, len(closing), False)
    assert parse_response(bytearray(b"HTTP/1.1 204 No Content\r\n\r\n")) == (204, 27, True)
    with pytest.raises(ResponseError):
        parse_response(bytearray(b"SSH-2.0-OpenSSH\r\n\r\n"))
    with pytest.raises(ResponseError):
        parse_response(bytearray(b"HTTP/1.1 200 OK\r\nServer: x\r\n\r\nbody"))
    with pytest.raises(ResponseError):
        parse_response(bytearray(b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n"))
    with pytest.raises(ResponseError):
        parse_response(bytearray(b"x" * 70_000))


class _Server:
    """Answers POST /ok (fixed length), /chunked, /close (closes after each
    answer), /busy (503 every other request), /slow (/ok after 20 ms) and
    /hang (not before the test ends)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.busy = 0
        self.release = asyncio.Event()  # set at teardown: /hang answers then
        self.peers: set[object] = set()  # client (host, port) of each connection used

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/ok", self.ok)
        app.router.add_post("/chunked", self.chunked)
        app.router.add_post("/close", self.close)
        app.router.add_post("/busy", self.busy_every_other)
        app.router.add_post("/hang", self.hang)
        app.router.add_post("/slow", self.slow)
        return app

    async def ok(self, req: web.Request) -> web.Response:
        self.bodies.append(await req.read())
        assert req.transport is not None
        self.peers.add(req.transport.get_extra_info("peername"))
        return web.Response(body=b'{"ok":true}')

    async def chunked(self, req: web.Request) -> web.StreamResponse:
        self.bodies.append(await req.read())
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(req)
        await resp.write(b"part one ")
        await resp.write(b"part two")
        await resp.write_eof()
        return resp

    async def close(self, req: web.Request) -> web.Response:
        self.bodies.append(await req.read())
        return web.Response(body=b"bye", headers={"Connection": "close"})

    async def busy_every_other(self, req: web.Request) -> web.Response:
        await req.read()
        self.busy += 1
        if self.busy % 2:
            return web.Response(status=503, headers={"Retry-After": "1"})
        return web.Response(body=b"ok")

    async def slow(self, req: web.Request) -> web.Response:
        await asyncio.sleep(0.02)
        return await self.ok(req)

    async def hang(self, req: web.Request) -> web.Response:
        await self.release.wait()
        return web.Response()


@pytest.fixture
async def server() -> AsyncIterator[tuple[_Server, str]]:
    s = _Server()
    runner = web.AppRunner(s.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield s, f"http://127.0.0.1:{port}"
    finally:
        s.release.set()
        await runner.cleanup()


@pytest.mark.parametrize("client", loadgen.CLIENTS)
@pytest.mark.parametrize("path", ["/ok", "/chunked", "/close"])
async def test_closed_loop_counts_every_answer(
    server: tuple[_Server, str], client: str, path: str
) -> None:
    s, base = server
    out = await closed_loop(
        base + path,
        b"payload-1",
        concurrency=4,
        duration_s=5.0,
        msgs_per_req=3,
        total_requests=40,
        client=client,
    )
    assert out["requests_ok"] == 40 and out["errors"] == {}
    assert out["client"] == client
    assert s.bodies == [b"payload-1"] * 40  # the request body arrives whole, once per request
    assert out["msg_per_s"] == pytest.approx(3 * out["req_per_s"])


@pytest.mark.parametrize("client", loadgen.CLIENTS)
async def test_non_200_answers_are_errors_by_status(
    server: tuple[_Server, str], client: str
) -> None:
    _, base = server
    out = await closed_loop(
        base + "/busy",
        b"x",
        concurrency=1,
        duration_s=5.0,
        msgs_per_req=1,
        total_requests=5,
        client=client,
    )
    assert out["requests_ok"] == 5
    assert out["errors"] == {"503": 5}


async def test_lean_client_times_out_instead_of_hanging(server: tuple[_Server, str]) -> None:
    _, base = server
    out = await closed_loop(
        base + "/hang", b"x", concurrency=2, duration_s=0.5, msgs_per_req=1, timeout_s=0.3
    )
    assert out["requests_ok"] == 0
    assert out["errors"].get("TimeoutError", 0) >= 2


async def test_lean_client_counts_a_refused_connection() -> None:
    # a port nobody listens on: bind one, then close it
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    out = await closed_loop(
        f"http://127.0.0.1:{port}/x", b"x", concurrency=1, duration_s=0.2, msgs_per_req=1
    )
    assert out["requests_ok"] == 0
    assert out["errors"].get("ConnectionRefusedError", 0) >= 1


@pytest.mark.parametrize("client", loadgen.CLIENTS)
async def test_open_loop_sends_what_it_offers_through_a_bounded_pool(
    server: tuple[_Server, str], client: str
) -> None:
    s, base = server
    out = await open_loop(
        base + "/slow",
        b"p",
        rate=400.0,
        duration_s=0.5,
        msgs_per_req=1,
        connections=3,
        client=client,
    )
    assert out["requests_ok"] == 200 and out["errors"] == {}
    assert len(s.bodies) == 200
    # answers take 20 ms, so 8 would be in flight at 400/s: all 3 connections
    # are used, and never more than the pool holds
    assert len(s.peers) == 3
    assert out["latency_ms"]["p50"] > 0


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError):
        loadgen.LeanClient("https://127.0.0.1:1/x", b"", "a/b", 1.0)
    with pytest.raises(ValueError):
        asyncio.run(
            closed_loop(
                "http://x/", b"", concurrency=1, duration_s=0.1, msgs_per_req=1, client="curl"
            )
        )
