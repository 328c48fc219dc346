"""The express lane (http_api/protocol.py): which requests it takes, and that
what it answers is what aiohttp's path answers: bodies, errors, order of
pipelined answers, timeouts, and the connection handed to aiohttp for good
at the first request it does not take."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from dledger.cluster import http_request
from http_api.app import BrokerApi
from http_api.protocol import NEED_MORE, answer_bytes, express_head
from http_api.server import API_KEY, express_of, make_node_app
from tests.http.onenode import serve_one_node
from tests.http.test_edges import _cfg, parse_answer

HEAD = b"POST /v1/topics/t/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def produce(value: str, *, extra: bytes = b"", topic: bytes = b"t") -> bytes:
    body = json.dumps({"messages": [{"value": value, "encoding": "utf-8", "queue": 0}]}).encode()
    head = HEAD.replace(b"/t/", b"/" + topic + b"/")
    return head + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


GET_TOPICS = b"GET /v1/topics HTTP/1.1\r\nHost: x\r\n\r\n"


def api_of(c: TestClient[Any, Any]) -> BrokerApi:
    return c.server.app[API_KEY]


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    cfg = _cfg(tmp_path, http_idle_timeout_ms=1500, http_body_timeout_ms=2000)
    async with serve_one_node(cfg) as c:
        r = await c.post("/v1/topics", json={"name": "t", "queues": 2})
        assert r.status == 201
        yield c


class Conn:
    """One raw connection: write bytes, read whole answers in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.buf = reader, writer, b""

    @classmethod
    async def open(cls, c: TestClient[Any, Any]) -> Conn:
        assert c.server.port is not None
        return cls(*await asyncio.open_connection("127.0.0.1", c.server.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, timeout_s: float = 10) -> tuple[int, dict[str, str], Any]:
        async with asyncio.timeout(timeout_s):
            while True:
                head, sep, rest = self.buf.partition(b"\r\n\r\n")
                if sep:
                    _, headers, _ = parse_answer(head + b"\r\n\r\n")
                    n = int(headers["content-length"])
                    if len(rest) >= n:
                        self.buf = rest[n:]
                        return parse_answer(head + sep + rest[:n])
                chunk = await self.reader.read(65536)
                if not chunk:
                    raise ConnectionError(f"closed; had {self.buf[:200]!r}")
                self.buf += chunk

    async def closed(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                return await self.reader.read(1) == b""
        except TimeoutError:
            return False

    def close(self) -> None:
        self.writer.close()


async def read_queue(c: TestClient[Any, Any]) -> list[str]:
    r = await c.get("/v1/topics/t/queues/0/messages?offset=0&max_messages=100&encoding=utf-8")
    assert r.status == 200
    return [m["value"] for m in (await r.json())["messages"]]


# -- which requests the lane takes ----------------------------------------------------
TAKEN = produce("v")
NOT_TAKEN: dict[str, bytes] = {
    "lower_case_method": TAKEN.replace(b"POST", b"post", 1),
    "http_1_0": TAKEN.replace(b"HTTP/1.1", b"HTTP/1.0", 1),
    "other_query": TAKEN.replace(b"/messages ", b"/messages?timeout=5 ", 1),
    "two_timeouts": TAKEN.replace(b"/messages ", b"/messages?timeout_ms=5&timeout_ms=6 ", 1),
    "timeout_out_of_bounds": TAKEN.replace(b"/messages ", b"/messages?timeout_ms=600001 ", 1),
    "timeout_zero": TAKEN.replace(b"/messages ", b"/messages?timeout_ms=0 ", 1),
    "timeout_signed": TAKEN.replace(b"/messages ", b"/messages?timeout_ms=+5 ", 1),
    "empty_query": TAKEN.replace(b"/messages ", b"/messages? ", 1),
    "percent_encoding": TAKEN.replace(b"/t/", b"/%74/", 1),
    "dot_topic": TAKEN.replace(b"/t/", b"/../", 1),
    "other_route": TAKEN.replace(b"/messages ", b"/messagez ", 1),
    "unknown_field": produce("v", extra=b"X-Trace: 1\r\n"),
    "authorization": produce("v", extra=b"Authorization: Bearer abcdefghijklmnop\r\n"),
    "content_encoding": produce("v", extra=b"Content-Encoding: identity\r\n"),
    "expect": produce("v", extra=b"Expect: 100-continue\r\n"),
    "chunked": produce("v", extra=b"Transfer-Encoding: chunked\r\n"),
    "connection_close": produce("v", extra=b"Connection: close\r\n"),
    "repeated_field": produce("v", extra=b"Host: y\r\n"),
    "other_content_type": TAKEN.replace(b"application/json", b"text/plain", 1),
    "accept_arrow": produce("v", extra=b"Accept: application/vnd.apache.arrow.stream\r\n"),
    "space_before_colon": produce("v", extra=b"Accept : */*\r\n"),
    "folded_line": produce("v", extra=b"User-Agent: a\r\n b\r\n"),
    "bare_lf_in_value": produce("v", extra=b"User-Agent: a\nX-A: b\r\n"),
    "nul_in_value": produce("v", extra=b"User-Agent: a\x00\r\n"),
    "signed_length": TAKEN.replace(b"Content-Length: ", b"Content-Length: +", 1),
    "no_length": HEAD + b"\r\n",
    "body_too_big": HEAD + b"Content-Length: %d\r\n\r\n" % (64 * 1024 + 1),
    "garbage": b"\x16\x03\x01\x00\xc4\x01\x00\x00\xc0\x03\x03" + b"\x00" * 40,
}


def test_the_lane_takes_plain_produce_requests_only() -> None:
    framed = express_head(TAKEN)
    assert isinstance(framed, tuple)
    topic, timeout_ms, start, length, binary = framed
    assert topic == "t" and TAKEN[start:].startswith(b"{") and len(TAKEN) == start + length
    assert timeout_ms is None and binary is False
    as_batch = TAKEN.replace(b"application/json", b"Application/Vnd.Dledger.Batch", 1)
    assert express_head(as_batch)[4] is True  # type: ignore[index]
    timed = TAKEN.replace(b"/messages ", b"/messages?timeout_ms=600000 ", 1)
    assert express_head(timed)[:2] == ("t", 600_000)  # type: ignore[index]
    # the fields a client library sends, any case, tabs around values
    ok = produce("v", extra=b"user-agent:\tpython-requests/2\r\nACCEPT: */*\r\n")
    ok = ok.replace(b"Host: x", b"Host: x\r\nConnection: Keep-Alive\r\nAccept-Encoding: gzip")
    assert isinstance(express_head(ok), tuple)
    assert isinstance(express_head(produce("v", topic=b"a-b_c.9")), tuple)
    for name, raw in NOT_TAKEN.items():
        assert express_head(raw) is None, name
    # the body cap of the node, when lower than the lane's own
    assert express_head(TAKEN, max_body=length - 1) is None


def test_an_incomplete_head_waits_while_it_may_still_be_taken() -> None:
    for cut in (1, 5, len(b"POST /v1/topics/"), len(HEAD) - 2):
        assert express_head(TAKEN[:cut]) == NEED_MORE, cut
    assert express_head(b"GET /") is None
    assert express_head(b"POST /v2") is None
    assert express_head(HEAD + b"User-Agent: " + b"a" * 9000) is None  # too long a head


def test_error_answers_keep_their_headers() -> None:
    from http_api.errors import envelope

    wire, close = answer_bytes(envelope(503, "NO_LEADER", "retry"))
    status, headers, body = parse_answer(wire)
    assert (status, headers["retry-after"], body["error"]["code"]) == (503, "1", "NO_LEADER")
    assert not close and "date" in headers
    wire, close = answer_bytes(b'{"a":1}')
    assert parse_answer(wire) == (200, parse_answer(wire)[1], {"a": 1}) and not close


# -- served ---------------------------------------------------------------------------------
async def test_a_plain_produce_is_answered_by_the_lane_as_aiohttp_would(
    client: TestClient[Any, Any],
) -> None:
    api = api_of(client)
    conn = await Conn.open(client)
    try:
        await conn.send(produce("fast"))
        st, headers, fast = await conn.answer()
        assert st == 200 and headers["content-type"] == "application/json"
        assert api.express_answers == 1
    finally:
        conn.close()
    conn = await Conn.open(client)
    try:
        await conn.send(produce("slow", extra=b"X-Trace: 1\r\n"))  # aiohttp's path
        st, _, slow = await conn.answer()
        assert st == 200 and api.express_answers == 1
    finally:
        conn.close()
    conn = await Conn.open(client)
    try:  # the route's timeout_ms: the lane's too
        await conn.send(produce("timed").replace(b"/messages ", b"/messages?timeout_ms=5000 "))
        assert (await conn.answer())[0] == 200 and api.express_answers == 2
    finally:
        conn.close()
    assert set(fast) == set(slow)
    assert fast["messages"][0]["queue_offset"] == 0 and slow["messages"][0]["queue_offset"] == 1
    assert await read_queue(client) == ["fast", "slow", "timed"]
    metrics = await (await client.get("/metrics")).text()
    assert "dledger_http_express_total 2" in metrics
    # both paths count on the produce route
    line = 'dledger_http_requests_total{method="POST",route="/v1/topics/{topic}/messages",status="200"} 3'
    assert line in metrics


async def test_pipelined_requests_are_answered_in_order_and_aiohttp_keeps_the_rest(
    client: TestClient[Any, Any],
) -> None:
    api = api_of(client)
    conn = await Conn.open(client)
    try:
        # three taken, then a GET: it and everything after it are aiohttp's
        await conn.send(produce("a") + produce("b") + produce("c") + GET_TOPICS + produce("d"))
        answers = [await conn.answer() for _ in range(5)]
        assert [a[0] for a in answers] == [200] * 5
        assert [a[2]["messages"][0]["queue_offset"] for a in answers[:3]] == [0, 1, 2]
        assert answers[3][2]["topics"][0]["name"] == "t"
        assert answers[4][2]["messages"][0]["queue_offset"] == 3
        assert api.express_answers == 3
        await conn.send(produce("e"))  # still aiohttp's
        assert (await conn.answer())[0] == 200 and api.express_answers == 3
    finally:
        conn.close()
    assert await read_queue(client) == ["a", "b", "c", "d", "e"]


async def test_a_request_in_pieces_is_taken_when_complete(client: TestClient[Any, Any]) -> None:
    api = api_of(client)
    raw = produce("pieces")
    conn = await Conn.open(client)
    try:
        for piece in (raw[:3], raw[3:30], raw[30 : len(raw) - 10], raw[len(raw) - 10 :]):
            await conn.send(piece)
            await asyncio.sleep(0.05)
        assert (await conn.answer())[0] == 200
        # and the next request on the connection, sent while nothing is in flight
        await conn.send(produce("next"))
        assert (await conn.answer())[0] == 200
        assert api.express_answers == 2
    finally:
        conn.close()
    assert await read_queue(client) == ["pieces", "next"]


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        (b"{not json", 400, None),
        (b'{"messages": 5}', 422, "messages"),
        (
            b'{"messages": [{"value": "x", "encoding": "utf-8", "queue": 99}]}',
            422,
            "messages[0].queue",
        ),
        (b'{"messages": [{"value": "eA=="}], "sequence": 1}', 422, "producer_id"),
    ],
)
async def test_bad_bodies_get_the_same_errors_and_the_connection_stays(
    client: TestClient[Any, Any], body: bytes, status: int, field: str | None
) -> None:
    api = api_of(client)
    answers = []
    for extra in (b"", b"X-Trace: 1\r\n"):  # the lane, then aiohttp's path
        conn = await Conn.open(client)
        try:
            await conn.send(HEAD + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            st, _, err = await conn.answer()
            answers.append((st, err))
            if not extra:
                assert api.express_answers == 1
                await conn.send(produce("after"))  # the lane answers the next one
                assert (await conn.answer())[0] == 200
        finally:
            conn.close()
    (st, err), (st2, err2) = answers
    assert st == st2 == status, answers
    assert err == err2, answers  # same code, message and field
    if field is not None:
        assert err["error"]["field"] == field
    assert await read_queue(client) == ["after"]


async def test_an_unknown_topic_is_404_by_either_path(client: TestClient[Any, Any]) -> None:
    got = []
    for extra in (b"", b"X-Trace: 1\r\n"):
        conn = await Conn.open(client)
        try:
            await conn.send(produce("x", topic=b"nope", extra=extra))
            got.append(await conn.answer())
        finally:
            conn.close()
    assert got[0][0] == got[1][0] == 404 and got[0][2] == got[1][2]
    assert got[0][2]["error"]["code"] == "UNKNOWN_TOPIC"
    assert api_of(client).express_answers == 1


async def test_timeouts_of_the_lane(client: TestClient[Any, Any]) -> None:
    # a body that stops arriving: 408 within the body timeout, closed
    conn = await Conn.open(client)
    try:
        raw = produce("late")
        await conn.send(raw[:-5])
        st, _, err = await conn.answer(timeout_s=5)
        assert st == 408 and err["error"]["code"] == "REQUEST_TIMEOUT"
        assert await conn.closed(2)
    finally:
        conn.close()
    # an idle connection after an answer: closed after the idle timeout
    conn = await Conn.open(client)
    try:
        await conn.send(produce("then idle"))
        assert (await conn.answer())[0] == 200
        assert not await conn.closed(0.5)
        assert await conn.closed(3)
    finally:
        conn.close()
    # a connection in use stays open past the idle timeout counted from its
    # opening (aiohttp's own timer for a connection it never saw a request on)
    conn = await Conn.open(client)
    try:
        for i in range(12):  # 2.4 s, the idle timeout is 1.5 s
            await conn.send(produce(f"busy {i}"))
            assert (await conn.answer())[0] == 200
            await asyncio.sleep(0.2)
    finally:
        conn.close()
    assert (await read_queue(client))[:2] == ["then idle", "busy 0"]


async def test_aiohttp_keeps_a_connection_the_lane_handed_over(
    client: TestClient[Any, Any],
) -> None:
    """The lane's idle timeout does not close a connection aiohttp took
    over: a long poll past it is answered."""
    conn = await Conn.open(client)
    try:
        await conn.send(produce("one"))
        assert (await conn.answer())[0] == 200
        poll = (
            b"GET /v1/topics/t/queues/1/messages?offset=0&wait_ms=2500 HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        await conn.send(poll)  # the idle timeout is 1.5 s
        st, _, page = await conn.answer(timeout_s=6)
        assert st == 200 and page["messages"] == []
    finally:
        conn.close()


async def test_no_lane_when_a_composition_adds_a_middleware(
    client: TestClient[Any, Any],
) -> None:
    """A broker group's agent adds a middleware that routes produce
    requests (421 WRONG_GROUP, queue assignment): the lane would skip it,
    so an app with a middleware of its own gets no lane."""
    node = api_of(client).node
    app = make_node_app(node)
    assert express_of(node, app) is not None

    @web.middleware
    async def extra(request: web.Request, handler: Any) -> web.StreamResponse:
        return await handler(request)

    app.middlewares.append(extra)
    assert express_of(node, app) is None


async def test_a_composition_s_produce_hook_runs_on_the_lane_as_in_its_middleware(
    tmp_path: Path,
) -> None:
    """A middleware that registers what it does to a produce body (as a
    broker group's agent does: refuse another group's queue with 421, fill
    in this group's queue) keeps the lane on, and the lane runs it: the same
    answers, the same stored messages, whichever path a request takes."""
    from http_api.errors import envelope
    from http_api.guard import JSON_BODY
    from http_api.server import PRODUCE_HOOKS

    def route(topic: str, body: dict[str, Any]) -> web.Response | None:
        for k, m in enumerate(body["messages"]):
            if m.get("queue") == 1:
                return envelope(
                    421, "WRONG_GROUP", "queue 1 is elsewhere", field=f"messages[{k}].queue"
                )
            m["queue"] = 0
        return None

    @web.middleware
    async def agent(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST" and request.path.endswith("/messages"):
            refused = route(request.match_info["topic"], request[JSON_BODY])
            if refused is not None:
                return refused
        return await handler(request)

    def compose(app: web.Application) -> None:
        app.middlewares.append(agent)
        app[PRODUCE_HOOKS] = {agent: route}

    async with serve_one_node(_cfg(tmp_path), compose) as c:
        assert (await c.post("/v1/topics", json={"name": "t", "queues": 2})).status == 201
        conn = await Conn.open(c)
        try:
            wrong = produce("w").replace(b'"queue": 0', b'"queue": 1')
            # the lane, then aiohttp (a field the lane does not take)
            for path, extra in (("lane", b""), ("aiohttp", b"X-Trace: 1\r\n")):
                before = api_of(c).express_answers
                req = wrong.replace(b"Host: x\r\n", b"Host: x\r\n" + extra)
                await conn.send(req)
                st, _, doc = await conn.answer()
                assert (st, doc["error"]["code"], doc["error"]["field"]) == (
                    421,
                    "WRONG_GROUP",
                    "messages[0].queue",
                )
                body = json.dumps({"messages": [{"value": path, "encoding": "utf-8"}]}).encode()
                none = HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body
                await conn.send(none.replace(b"Host: x\r\n", b"Host: x\r\n" + extra))
                st, _, doc = await conn.answer()
                assert st == 200 and doc["messages"][0]["queue"] == 0
                assert api_of(c).express_answers - before == (2 if path == "lane" else 0)
        finally:
            conn.close()
        assert await read_queue(c) == ["lane", "aiohttp"]


async def test_the_lane_can_be_turned_off(tmp_path: Path) -> None:
    async with serve_one_node(_cfg(tmp_path, http_express=False)) as c:
        assert (await c.post("/v1/topics", json={"name": "t", "queues": 2})).status == 201
        conn = await Conn.open(c)
        try:
            await conn.send(produce("x"))
            assert (await conn.answer())[0] == 200
        finally:
            conn.close()
        assert api_of(c).express_answers == 0


def test_a_follower_redirects_the_lane_to_the_leader(api_cluster: Any) -> None:
    """On a real cluster: a follower answers the lane's produce with the
    NOT_LEADER redirect (same target), and the leader's lane takes it."""
    c = api_cluster(voters=3)
    leader = c.wait_leader(30)
    assert c.call("POST", "/v1/topics", {"name": "t", "queues": 2})[0] == 201
    follower = next(i for i in c.ids() if i != leader)
    body = json.dumps({"messages": [{"value": "r", "encoding": "utf-8"}]}).encode()
    headers = {"Content-Type": "application/json"}
    r = http_request(c.http(follower), "POST", "/v1/topics/t/messages", body, 10, headers)
    err = r.json()
    assert r.status == 307 and err["error"]["code"] == "NOT_LEADER", err
    assert err["error"]["leader"] == leader
    assert r.headers["location"] == f"http://{c.http(leader)}/v1/topics/t/messages"
    r = http_request(c.http(leader), "POST", "/v1/topics/t/messages", body, 10, headers)
    assert r.status == 200, r.body
    assert r.json()["messages"][0]["queue_offset"] == 0
    metrics = http_request(c.http(leader), "GET", "/metrics").body.decode()
    assert "dledger_http_express_total 1" in metrics
    metrics = http_request(c.http(follower), "GET", "/metrics").body.decode()
    assert "dledger_http_express_total 1" in metrics
