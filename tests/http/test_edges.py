"""A replay of every request issue #13 lists, against one node served with
the node's own connection handling (http_api/protocol.py): each is answered
below 500, in the error envelope, with the expected status, and never with
the request's raw bytes echoed. Parser-level requests go over raw sockets."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import re
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from dledger.config import NodeConfig
from http_api.guard import GUARD_KEY
from tests.http.onenode import serve_one_node

MARK = "ZQXECHO"  # in every malformed part: the answer must not contain it


def _cfg(tmp_path: Path, **kw: Any) -> NodeConfig:
    return NodeConfig(
        node_id=1,
        cluster_id="edges",
        raft_host="127.0.0.1",
        raft_port=1,
        http_host="127.0.0.1",
        http_port=2,
        data_dir=str(tmp_path / "n1"),
        **kw,
    )


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    async with serve_one_node(_cfg(tmp_path)) as c:
        r = await c.post("/v1/topics", json={"name": "t", "queues": 2})
        assert r.status == 201
        yield c


async def raw_exchange(c: TestClient[Any, Any], data: bytes, timeout_s: float = 10) -> bytes:
    """Send ``data`` on a fresh connection; everything the node answers
    until it closes the connection (or stays silent for ``timeout_s``)."""
    assert c.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", c.server.port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        while True:
            try:
                async with asyncio.timeout(timeout_s):
                    chunk = await reader.read(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and _complete(out):
                break
        return out
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


def _complete(raw: bytes) -> bool:
    head, _, body = raw.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def parse_answer(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, json.loads(body) if body else None


def assert_envelope(raw: bytes, status: int | tuple[int, ...]) -> dict[str, Any]:
    assert raw, "the node closed the connection without an answer"
    st, headers, body = parse_answer(raw)
    want = (status,) if isinstance(status, int) else status
    assert st in want, raw[:300]
    assert headers.get("content-type", "").startswith("application/json"), raw[:300]
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["code"], str) and re.fullmatch("[A-Z0-9_]+", err["code"])
    assert isinstance(err["message"], str)
    assert MARK.encode() not in raw and MARK.lower().encode() not in raw, raw[:300]
    return dict(err)


GET = b"GET /v1/topics HTTP/1.1\r\nHost: x\r\n"
POST = b"POST /v1/topics/t/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
BODY = b'{"messages":[{"value":"x","encoding":"utf-8"}]}'
M = MARK.encode()

PARSER_CASES: dict[str, bytes] = {
    "bad_content_length": POST + b"Content-Length: 12" + M + b"\r\n\r\n" + BODY,
    "duplicate_content_length": POST
    + b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(BODY)
    + BODY,
    "content_length_and_chunked": POST
    + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(BODY)
    + BODY,
    "bare_lf": b"GET /v1/topics HTTP/1.1\nHost: x\nX-A: " + M + b"\n\n",
    "nul_in_header": GET + b"X-A: a\x00" + M + b"\r\n\r\n",
    "long_header": GET + b"X-A: " + M + b"a" * 9000 + b"\r\n\r\n",
    "long_url": b"GET /v1/topics?" + M + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "thousand_headers": GET + b"".join(b"X-H%d: %s\r\n" % (i, M) for i in range(1000)) + b"\r\n",
    "unknown_method": M + b" /v1/topics HTTP/1.1\r\nHost: x\r\n\r\n",
    "http2_preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + M,
    "tls_hello": bytes.fromhex("16030100c4010000c00303") + M + b"\x00" * 64,
    "bad_chunk": POST + b"Transfer-Encoding: chunked\r\n\r\nZZ" + M + b"\r\n",
}


@pytest.mark.parametrize("case", sorted(PARSER_CASES))
async def test_parser_errors_are_enveloped(client: TestClient[Any, Any], case: str) -> None:
    raw = await raw_exchange(client, PARSER_CASES[case])
    err = assert_envelope(raw, (400, 413, 414, 431))
    assert err["code"] != "INTERNAL"


def _post(headers: dict[str, str], body: bytes) -> bytes:
    hs = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (
        b"POST /v1/topics/t/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + hs.encode()
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


async def test_content_encodings(client: TestClient[Any, Any]) -> None:
    good = gzip.compress(BODY)
    raw = await raw_exchange(client, _post({"Content-Encoding": "gzip"}, good))
    assert parse_answer(raw)[0] == 200, raw[:300]
    deflated = zlib.compress(BODY)
    raw = await raw_exchange(client, _post({"Content-Encoding": "deflate"}, deflated))
    assert parse_answer(raw)[0] == 200, raw[:300]
    for enc in ("br", "zstd", "gzip, gzip", M.decode()):
        raw = await raw_exchange(client, _post({"Content-Encoding": enc}, good))
        assert assert_envelope(raw, 415)["code"] == "UNSUPPORTED_CONTENT_ENCODING"
    for enc in ("gzip", "deflate"):  # a body that is not compressed: 400, was a 500
        raw = await raw_exchange(client, _post({"Content-Encoding": enc}, BODY))
        assert assert_envelope(raw, 400)["code"] == "BAD_CONTENT_ENCODING"
    raw = await raw_exchange(client, _post({"Content-Encoding": "gzip"}, good[:-9]))
    assert assert_envelope(raw, 400)["code"] == "BAD_CONTENT_ENCODING"
    raw = await raw_exchange(client, _post({"Content-Encoding": "gzip"}, good + b"junk"))
    assert assert_envelope(raw, 400)["code"] == "BAD_CONTENT_ENCODING"


async def test_gzip_bomb_is_413(client: TestClient[Any, Any]) -> None:
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = co.compress(b"\0" * (64 << 20)) + co.flush()
    raw = await raw_exchange(client, _post({"Content-Encoding": "gzip"}, bomb))
    assert assert_envelope(raw, 413)["code"] == "PAYLOAD_TOO_LARGE"


async def test_declared_content_length_above_the_cap_is_413_before_the_body(
    client: TestClient[Any, Any],
) -> None:
    head = (
        b"POST /v1/topics/t/messages HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n{}"
    )
    raw = await raw_exchange(client, head)  # the 10^12 bytes never come
    assert assert_envelope(raw, 413)["code"] == "PAYLOAD_TOO_LARGE"


async def test_duplicate_authorization_is_400(client: TestClient[Any, Any]) -> None:
    req = GET + b"Authorization: Bearer aaaaaaaaaaaaaaaaaaaa\r\n" * 2 + b"\r\n"
    raw = await raw_exchange(client, req)
    assert_envelope(raw, 400)


async def _json(c: TestClient[Any, Any], method: str, path: str, body: Any = None) -> Any:
    if body is None:
        r = await c.request(method, path)
    else:
        data = io.BytesIO(json.dumps(body).encode())  # big bodies: not raw bytes (aiohttp warns)
        r = await c.request(method, path, data=data, headers={"Content-Type": "application/json"})
    return r.status, await r.json()


@pytest.mark.parametrize("name", [".", ".."])
async def test_dot_topic_names_are_refused(client: TestClient[Any, Any], name: str) -> None:
    st, res = await _json(client, "POST", "/v1/topics", {"name": name})
    assert st == 422 and res["error"]["field"] == "name", res


BAD_QUERIES = [
    ("POST", "/v1/topics/t/messages?timeout_ms=0", "timeout_ms"),
    ("POST", "/v1/topics/t/messages?timeout_ms=600001", "timeout_ms"),
    ("GET", "/v1/topics/t/queues/0/messages?offset=%2B1", "offset"),
    ("GET", "/v1/topics/t/queues/0/messages?offset=%201", "offset"),
    ("GET", "/v1/topics/t/queues/0/messages?offset=1%20", "offset"),
    ("GET", "/v1/topics/t/queues/0/messages?offset=-1", "offset"),
    ("GET", "/v1/topics/t/queues/0/messages?offset=%EF%BC%91", "offset"),  # fullwidth 1
    ("GET", "/v1/topics/t/queues/0/messages?offset=%D9%A1", "offset"),  # Arabic-Indic 1
    ("GET", "/v1/topics/t/queues/0/messages?offset=", "offset"),
    ("GET", "/v1/topics/t/queues/0/messages?offset=1&offset=2", "offset"),
    ("GET", "/v1/topics/t/queues/0/messages?encoding=utf-16", "encoding"),
    ("GET", "/v1/topics/t/queues/0/messages?max_messages=1001", "max_messages"),
    ("GET", "/v1/topics/t/queues/0/messages?offest=1", "offest"),
    ("GET", "/v1/topics/t/queues/%EF%BC%91/messages", "queue"),
    ("GET", "/v1/topics/t/queues/%D9%A1/messages", "queue"),
    ("GET", "/v1/topics/t/queues/+1/messages", "queue"),
    ("GET", "/v1/topics?consistency=strong", "consistency"),
    ("POST", "/raft/transfer", "to"),
]


@pytest.mark.parametrize(("method", "path", "field"), BAD_QUERIES)
async def test_bad_query_and_path_values_are_422(
    client: TestClient[Any, Any], method: str, path: str, field: str
) -> None:
    body = {"messages": [{"value": "x", "encoding": "utf-8"}]} if method == "POST" else None
    st, res = await _json(client, method, path, body)
    assert st == 422 and res["error"]["field"] == field, (st, res)


BAD_BODIES = [
    ({"messages": [{"value": "test", "encodng": "utf-8"}]}, "messages[0].encodng"),
    ({"messages": [{"value": "x"}], "extra": 1}, "extra"),
    ({"messages": [{"value": "x", "born_ts_ms": -1}]}, "messages[0].born_ts_ms"),
    ({"messages": [{"value": "x", "queue": True}]}, "messages[0].queue"),
    ({"messages": [{"value": "x", "properties": {str(i): "" for i in range(65)}}]},
     "messages[0].properties"),
    ({"messages": [{"value": "AA=="}] * 10_001}, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
async def test_bad_bodies_are_422_naming_the_field(
    client: TestClient[Any, Any], body: Any, field: str
) -> None:
    st, res = await _json(client, "POST", "/v1/topics/t/messages", body)
    assert st == 422 and res["error"]["field"] == field, (st, res)


async def test_typo_stores_nothing(client: TestClient[Any, Any]) -> None:
    st, _ = await _json(
        client, "POST", "/v1/topics/t/messages", {"messages": [{"value": "t", "encodng": "x"}]}
    )
    assert st == 422
    st, res = await _json(client, "GET", "/v1/topics/t")
    assert all(q["max_offset"] == 0 for q in res["queues"]), res


async def test_connection_cap_refuses_with_503(tmp_path: Path) -> None:
    async with serve_one_node(_cfg(tmp_path, http_max_connections=4)) as c:
        assert c.server.port is not None
        held = [await asyncio.open_connection("127.0.0.1", c.server.port) for _ in range(4)]
        try:
            raw = await raw_exchange(c, GET + b"\r\n")
            err = assert_envelope(raw, 503)
            assert err["code"] == "TOO_MANY_CONNECTIONS"
        finally:
            for _, w in held:
                w.close()
        # once they are gone, a client is served again
        for _ in range(100):
            r = await c.get("/v1/topics")
            if r.status == 200:
                break
            await asyncio.sleep(0.05)
        assert r.status == 200


async def test_the_document_publishes_the_caps_and_metrics_the_loop_lag(
    client: TestClient[Any, Any],
) -> None:
    st, doc = await _json(client, "GET", "/openapi.json")
    assert st == 200
    limits = doc["info"]["x-limits"]
    assert limits["max_batch_messages"] == 4096 and limits["http_max_connections"] == 1024
    msg = doc["components"]["schemas"]["MessageIn"]["properties"]["properties"]
    assert msg["maxProperties"] == limits["max_message_properties"]
    r = await client.get("/metrics")
    text = await r.text()
    assert "dledger_loop_lag_max_seconds " in text
    assert "dledger_loop_lag_seconds_bucket" in text  # Node.loop_lag_seconds


async def test_bodies_beyond_the_caps_are_refused_off_the_loop(tmp_path: Path) -> None:
    """A body that may hold more values than the caps allow is parsed and
    checked in the helper process (http_api/parse_worker.py) first."""
    async with serve_one_node(_cfg(tmp_path)) as c:
        assert (await c.post("/v1/topics", json={"name": "t"})).status == 201
        many = {"messages": [{"value": "AA=="}] * 200_000}
        st, res = await _json(c, "POST", "/v1/topics/t/messages", many)
        assert st == 422 and res["error"]["field"] == "messages", res
        props = {
            "messages": [{"value": "AA==", "properties": {str(i): "" for i in range(200_000)}}]
        }
        st, res = await _json(c, "POST", "/v1/topics/t/messages", props)
        assert st == 422 and res["error"]["field"] == "messages[0].properties", res
        st, res = await _json(
            c, "POST", "/v1/topics/t/messages", {"messages": [{"value": 1}] * 50_000}
        )
        assert st == 422 and res["error"]["field"] == "messages", res
        r = await c.post(
            "/v1/topics/t/messages",
            data=io.BytesIO(b'{"messages": [' + b"{}," * 100_000),
            headers={"Content-Type": "application/json"},
        )
        assert r.status == 400 and (await r.json())["error"]["code"] == "BAD_REQUEST"
        # separators inside strings only loosen the bound: checked, then accepted
        text = ":,{[" * 250
        ok = {"messages": [{"value": text, "encoding": "utf-8"}] * 300}
        st, res = await _json(c, "POST", "/v1/topics/t/messages", ok)
        assert st == 200 and len(res["messages"]) == 300, res
        guard = c.server.app[GUARD_KEY]
        assert guard.worker is not None and guard.worker._proc is not None
        proc = guard.worker._proc
    await asyncio.wait_for(proc.wait(), 10)  # the helper goes with the app
