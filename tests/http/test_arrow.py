"""The consume route's Arrow answer (``Accept: application/vnd.apache.arrow.stream``):
the same messages and offsets as the JSON answer to the same request, errors
still JSON envelopes with their status, a damaged record a 503, and 406 on a
node without pyarrow. In-process on one node, plus the 307 of a follower on
a live cluster."""

from __future__ import annotations

import asyncio
import base64
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from aiohttp.test_utils import TestClient

from broker_adapter.errors import MalformedCommand
from dledger.cluster import http_request
from dledger.errors import StorageCorrupted
from http_api import arrow
from http_api.server import API_KEY
from tests.http.apiclient import ApiCluster, wait_for
from tests.http.test_api import conformance, err, make_topic, req

ARROW = {"Accept": arrow.ARROW_STREAM}
PAGE = "/v1/topics/{t}/queues/{q}/messages"


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    from tests.http.onenode import one_node_config, serve_one_node

    cfg = one_node_config(tmp_path, "arrow")
    async with serve_one_node(cfg) as c:
        yield c


async def get_arrow(c: TestClient[Any, Any], path: str) -> tuple[int, dict[str, str], Any]:
    """(status, headers, a pyarrow.Table or the JSON error body); conforming."""
    r = await c.get(path, headers=ARROW)
    raw = await r.read()
    (await conformance(c)).check("GET", path, r.status, dict(r.headers), raw)
    if r.content_type == arrow.ARROW_STREAM:
        return r.status, dict(r.headers), pa.ipc.open_stream(raw).read_all()
    return r.status, dict(r.headers), await r.json()


def rows_of(table: pa.Table) -> list[dict[str, Any]]:
    """The table's rows in the JSON answer's shape."""
    out = []
    for r in table.to_pylist():
        out.append(
            {
                "queue_offset": r["queue_offset"],
                "commit_offset": r["commit_offset"],
                "size": r["size"],
                "msg_id": r["msg_id"],
                "store_ts_ms": int(r["store_ts_ms"].timestamp() * 1000),
                "born_ts_ms": int(r["born_ts_ms"].timestamp() * 1000),
                "tags": r["tags"] or "",
                "keys": r["keys"],
                "properties": dict(r["properties"]),
                "value": base64.b64encode(r["value"]).decode(),
                "encoding": "base64",
            }
        )
    return out


async def produce_mixed(c: TestClient[Any, Any]) -> None:
    await make_topic(c, "t", 2)
    msgs = []
    for i in range(300):
        m: dict[str, Any] = {"value": base64.b64encode(bytes([i % 256]) * (i % 40)).decode()}
        m["queue"] = i % 2 if i < 200 else 1
        if i % 3 == 0:
            m["tags"] = "odd" if i % 2 else "even"
        if i % 4 == 0:
            m["keys"] = [f"k{i}", "x"]
        if i % 5 == 0:
            m["properties"] = {"i": str(i), "j": "v"}
        msgs.append(m)
    st, res = await req(c, "POST", "/v1/topics/t/messages", {"messages": msgs})
    assert st == 200, res


async def test_arrow_page_is_the_json_page(client: TestClient[Any, Any]) -> None:
    await produce_mixed(client)
    cases = [
        (q, f"offset={off}&max_messages={mm}&max_bytes={mb}{tag}")
        for q in (0, 1)
        for off in (0, 7, 99, 100)
        for mm, mb in ((1000, 1 << 20), (5, 1 << 20), (50, 300), (3, 1))
        for tag in ("", "&tag=odd", "&tag=even||odd")
    ]
    cases += [(1, "offset=199"), (1, "offset=200"), (1, "offset=0&max_messages=10"), (0, "")]
    for q, query in cases:
        path = PAGE.format(t="t", q=q) + "?" + query
        st, page = await req(client, "GET", path)
        assert st == 200, page
        st, headers, table = await get_arrow(client, path)
        assert st == 200, table
        assert table.schema == arrow.schema(pa), table.schema
        assert table.column("topic").to_pylist() == ["t"] * table.num_rows
        assert table.column("queue").to_pylist() == [q] * table.num_rows
        assert rows_of(table) == page["messages"], path
        assert int(headers["X-Next-Offset"]) == page["next_offset"]
        assert int(headers["X-Min-Offset"]) == page["min_offset"]
        assert int(headers["X-Max-Offset"]) == page["max_offset"]
        assert int(headers["X-Confirm-Offset"]) == page["confirm_offset"]
        assert int(headers["X-Message-Count"]) == len(page["messages"])
    # a page bigger than a JSON one may be (still bounded by max_bytes)
    st, headers, table = await get_arrow(client, PAGE.format(t="t", q=1) + "?max_messages=5000")
    assert st == 200 and table.num_rows == 200 and headers["X-Next-Offset"] == "200"
    st, res = await req(client, "GET", PAGE.format(t="t", q=1) + "?max_messages=5000")
    assert st == 422 and err(res)["field"] == "max_messages"


async def test_errors_stay_json_with_their_status(client: TestClient[Any, Any]) -> None:
    await make_topic(client, "t", 1)
    one = {"messages": [{"value": "x", "encoding": "utf-8"}]}
    st, _ = await req(client, "POST", "/v1/topics/t/messages", one)
    for path, status, code in [
        ("/v1/topics/nope/queues/0/messages", 404, "UNKNOWN_TOPIC"),
        ("/v1/topics/t/queues/0/messages?offset=9", 416, None),
        ("/v1/topics/t/queues/7/messages", 422, None),
        ("/v1/topics/t/queues/0/messages?max_messages=0", 422, None),
        ("/v1/topics/t/queues/0/messages?max_messages=10001", 422, None),
        ("/v1/topics/t/queues/0/messages?consistency=eventual", 422, None),
    ]:
        st, headers, body = await get_arrow(client, path)
        assert st == status, (path, body)
        assert headers["Content-Type"].startswith("application/json"), path
        e = err(body)
        if code is not None:
            assert e["code"] == code
        if status == 416:
            assert (e["min_offset"], e["max_offset"]) == (0, 1)
        # the same envelope as the JSON request's
        assert (st, body) == await req(client, "GET", path)


async def test_accept_negotiation(client: TestClient[Any, Any]) -> None:
    assert arrow.wants_arrow(arrow.ARROW_STREAM)
    assert arrow.wants_arrow(f"application/json;q=0.5, {arrow.ARROW_STREAM}")
    assert not arrow.wants_arrow(f"{arrow.ARROW_STREAM};q=0")
    assert not arrow.wants_arrow("application/json")
    assert not arrow.wants_arrow("*/*")
    assert not arrow.wants_arrow("")
    await make_topic(client, "t", 1)
    r = await client.get("/v1/topics/t/queues/0/messages", headers={"Accept": "*/*"})
    assert r.content_type == "application/json"  # JSON stays the default


async def test_long_poll_wakes_with_an_arrow_page(client: TestClient[Any, Any]) -> None:
    await make_topic(client, "t", 1)

    async def later() -> None:
        await asyncio.sleep(0.3)
        await req(client, "POST", "/v1/topics/t/messages", {"messages": [{"value": "AA=="}]})

    task = asyncio.create_task(later())
    st, headers, table = await get_arrow(client, PAGE.format(t="t", q=0) + "?wait_ms=5000")
    await task
    assert st == 200 and table.num_rows == 1 and headers["X-Next-Offset"] == "1"
    st, headers, table = await get_arrow(client, PAGE.format(t="t", q=0) + "?offset=1&wait_ms=200")
    assert st == 200 and table.num_rows == 0 and headers["X-Next-Offset"] == "1"


async def test_a_damaged_record_is_503_never_served(client: TestClient[Any, Any]) -> None:
    """tests/broker/test_properties.py's damaged record, through the Arrow answer."""
    await make_topic(client, "t", 1)
    body = {"messages": [{"value": "hello", "encoding": "utf-8"}, {"value": "d29ybGQ="}]}
    st, res = await req(client, "POST", "/v1/topics/t/messages", body)
    assert st == 200, res
    app = client.server.app
    assert app is not None
    sm = app[API_KEY].sm
    broker = sm.broker
    phys = res["messages"][0]["commit_offset"]
    rec = bytearray(broker.bodies.get(phys))
    rec[-1] ^= 0x01  # one bit of the body
    if broker.bodies.log_backed:
        # the record is in the log entry that carried it: damage it there
        node = app[API_KEY].node
        st_ = node._storage
        index = broker.bodies.index_of(phys)
        key = index.to_bytes(8, "big")
        st_.sync()  # the commit index moved since the last sync
        assert st_.checkpoint()  # LMDB, not only the write-ahead log, holds the entry
        with st_.env.begin(write=True) as txn:
            raw = bytearray(txn.get(key, db=st_._log_db))
            at = raw.find(bytes(rec[:-1]))
            assert at > 0
            raw[at + len(rec) - 1] ^= 0x01
            txn.put(key, bytes(raw), db=st_._log_db)
        rounds: tuple[bool, ...] = (True,)
    else:
        broker.bodies.put(phys, bytes(rec))
        rounds = (False, True)
    path = PAGE.format(t="t", q=0) + "?offset=0"
    for committed in rounds:  # a buffered write, then in LMDB (the cursor scan)
        if committed and not broker.bodies.log_backed:
            broker.bodies.commit()
        for st, res in (await req(client, "GET", path), (await get_arrow(client, path))[::2]):
            assert st == 503, res
            assert err(res)["code"] == "STORAGE_CORRUPTED" and "t/0@0" in err(res)["message"]
    st, _, table = await get_arrow(client, PAGE.format(t="t", q=0) + "?offset=1")
    if broker.bodies.log_backed:
        assert st == 503  # the same log entry carries both messages
    else:
        assert st == 200 and table.column("value").to_pylist() == [b"world"]
    # Found damage stops the replica (exit 2 from the CLI: rebuild it), and
    # every later request says why instead of serving around the hole.
    node = app[API_KEY].node
    await asyncio.wait_for(node.failed.wait(), 5)
    assert isinstance(node.fatal, StorageCorrupted) and not node.running
    for method, p, b in (
        ("POST", "/v1/topics/t/messages", {"messages": [{"value": "x", "encoding": "utf-8"}]}),
        ("GET", PAGE.format(t="t", q=0) + "?offset=1", None),
    ):
        st, res = await req(client, method, p, b)
        assert st == 503, res
        assert err(res)["code"] == "STORAGE_CORRUPTED" and "t/0@0" in err(res)["message"]
    # and the codec check is the one decode_record makes
    from broker_adapter import codec

    with pytest.raises(MalformedCommand, match="CRC"):
        codec.decode_columns([bytes(rec)])


async def test_406_without_pyarrow(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    await make_topic(client, "t", 1)
    monkeypatch.setattr(arrow, "_pa", None)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    st, _, body = await get_arrow(client, PAGE.format(t="t", q=0))
    assert st == 406 and err(body)["code"] == "ARROW_UNAVAILABLE", body
    assert "pyarrow" in err(body)["message"]
    st, page = await req(client, "GET", PAGE.format(t="t", q=0))  # JSON as ever
    assert st == 200 and page["messages"] == []


def test_follower_arrow_page_and_307(api_cluster: Callable[..., ApiCluster]) -> None:
    """On a live cluster: a follower's Arrow page equals its JSON page, and a
    linearizable Arrow read there is the JSON 307 naming the leader."""
    c = api_cluster(voters=3)
    st, res = c.call("POST", "/v1/topics", {"name": "f", "queues": 1})
    assert st == 201, res
    msgs = [{"value": f"v{i}", "encoding": "utf-8", "keys": [f"k{i}"]} for i in range(50)]
    st, res = c.call("POST", "/v1/topics/f/messages", {"messages": msgs})
    assert st == 200, res
    follower = next(n for n in c.ids() if n != c.leader_hint)
    path = "/v1/topics/f/queues/0/messages?offset=0&max_messages=100"

    def follower_has_all() -> bool:
        st, res = c.call("GET", path, via=follower, follow=False)
        return st == 200 and len(res["messages"]) == 50

    wait_for(follower_has_all, 30, "the follower to serve the committed messages")
    st, page = c.call("GET", path, via=follower, follow=False)
    r = http_request(c.http(follower), "GET", path, headers=ARROW, timeout_s=5)
    assert r.status == 200 and r.headers["content-type"] == arrow.ARROW_STREAM
    table = pa.ipc.open_stream(r.body).read_all()
    got = rows_of(table)
    for m in page["messages"]:  # the JSON page asked for base64
        assert m["encoding"] == "base64"
    assert got == page["messages"]
    assert int(r.headers["x-next-offset"]) == page["next_offset"] == 50
    lin = path + "&consistency=linearizable"
    r = http_request(c.http(follower), "GET", lin, headers=ARROW, timeout_s=5)
    assert r.status == 307, r.body
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["error"]["code"] == "NOT_LEADER" and body["error"]["leader"] == c.leader_hint
    assert r.headers["location"].endswith(lin)
