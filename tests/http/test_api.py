"""The /v1 API in-process against a real one-node Node (LMDB in tmp_path):
status codes and envelopes from the one error table, long-poll wake-up,
consistency modes and bounded bodies. The 307 redirect and failover are
covered by test_broker_cluster.py on real processes."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.http.conformance import Conformance
from tests.http.onenode import one_node_config, serve_one_node


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    cfg = one_node_config(tmp_path, "api", max_entry_bytes=256 << 10)
    async with serve_one_node(cfg) as c:
        yield c


_CONFORMANCE: dict[int, Conformance] = {}


async def conformance(c: TestClient[Any, Any]) -> Conformance:
    """The server's own /openapi.json, fetched once per client."""
    if id(c) not in _CONFORMANCE:
        r = await c.get("/openapi.json")
        _CONFORMANCE[id(c)] = Conformance(await r.json())
    return _CONFORMANCE[id(c)]


async def req(c: TestClient[Any, Any], method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request; its answer must conform to /openapi.json."""
    r = await c.request(method, path, json=body)
    raw = await r.read()
    (await conformance(c)).check(method, path, r.status, dict(r.headers), raw)
    return r.status, await r.json()


async def make_topic(c: TestClient[Any, Any], name: str = "t", queues: int = 2) -> None:
    st, res = await req(c, "POST", "/v1/topics", {"name": name, "queues": queues})
    assert st == 201, res


def err(res: Any) -> dict[str, Any]:
    e: dict[str, Any] = res["error"]
    assert isinstance(e["code"], str) and isinstance(e["message"], str)
    return e


async def test_produce_consume_roundtrip_and_topic_admin(client: TestClient[Any, Any]) -> None:
    await make_topic(client, "t", 2)
    body = {
        "messages": [
            {"value": "hello", "encoding": "utf-8", "queue": 1, "tags": "a", "keys": ["k"]},
            {"value": base64.b64encode(b"\x00\xff").decode(), "queue": 1, "properties": {"p": "v"}},
        ]
    }
    st, res = await req(client, "POST", "/v1/topics/t/messages", body)
    assert st == 200, res
    assert [m["queue_offset"] for m in res["messages"]] == [0, 1]
    assert res["messages"][0]["commit_offset"] < res["messages"][1]["commit_offset"]
    st, res = await req(client, "GET", "/v1/topics/t/queues/1/messages?offset=0")
    assert st == 200
    assert base64.b64decode(res["messages"][1]["value"]) == b"\x00\xff"
    assert res["messages"][0]["keys"] == ["k"] and res["messages"][1]["properties"] == {"p": "v"}
    assert (res["next_offset"], res["min_offset"], res["max_offset"]) == (2, 0, 2)
    st, res = await req(client, "GET", "/v1/topics/t/queues/1/messages?offset=0&tag=a")
    assert [m["queue_offset"] for m in res["messages"]] == [0]
    st, res = await req(
        client, "GET", "/v1/topics/t/queues/1/messages?offset=0&consistency=linearizable"
    )
    assert st == 200 and len(res["messages"]) == 2
    st, res = await req(client, "GET", "/v1/topics")
    assert [t["name"] for t in res["topics"]] == ["t"]
    st, res = await req(client, "PATCH", "/v1/topics/t", {"queues": 3})
    assert st == 200 and len(res["queues"]) == 3
    st, res = await req(client, "DELETE", "/v1/topics/t")
    assert st == 200
    st, res = await req(client, "GET", "/v1/topics/t")
    assert st == 404 and err(res)["code"] == "UNKNOWN_TOPIC"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"value": 1}]}, "messages[0].value"),
        ({"messages": [{"value": "!!", "encoding": "base64"}]}, "messages[0].value"),
        ({"messages": [{"value": "x", "encoding": "latin-1"}]}, "messages[0].encoding"),
        ({"messages": [{"value": "x", "encoding": "utf-8", "queue": 5}]}, "messages[0].queue"),
        ({"messages": [{"value": "x", "encoding": "utf-8", "queue": -1}]}, "messages[0].queue"),
        (
            {"messages": [{"value": "x", "encoding": "utf-8", "properties": {"a": 1}}]},
            "messages[0].properties.a",
        ),
        # a typo is not a field (it was stored as base64-decoded garbage)
        ({"messages": [{"value": "test", "encodng": "utf-8"}]}, "messages[0].encodng"),
        ({"messages": [{"value": "x", "encoding": "utf-8"}], "sequence": 0}, "producer_id"),
    ],
)
async def test_invalid_fields_are_422_naming_the_field(
    client: TestClient[Any, Any], body: Any, field: str
) -> None:
    await make_topic(client)
    st, res = await req(client, "POST", "/v1/topics/t/messages", body)
    assert st == 422, res
    assert err(res)["field"] == field


async def test_error_table(client: TestClient[Any, Any]) -> None:
    await make_topic(client, "t", 1)
    one = {"messages": [{"value": "x", "encoding": "utf-8"}]}
    st, res = await req(client, "POST", "/v1/topics/nope/messages", one)
    assert st == 404 and err(res)["code"] == "UNKNOWN_TOPIC"
    st, res = await req(client, "POST", "/v1/topics/bad%20name/messages", one)
    assert st == 422 and err(res)["code"] == "INVALID_TOPIC_NAME"
    st, res = await req(client, "POST", "/v1/topics", {"name": "t", "queues": 1})
    assert st == 409 and err(res)["code"] == "TOPIC_EXISTS"
    st, res = await req(client, "POST", "/v1/topics", {"name": "u", "queues": 2000})
    assert st == 422 and err(res)["field"] == "queues"
    st, res = await req(client, "POST", "/v1/topics/t/messages", one)
    st, res = await req(client, "GET", "/v1/topics/t/queues/0/messages?offset=9")
    assert st == 416
    assert (err(res)["min_offset"], err(res)["max_offset"]) == (0, 1)
    st, res = await req(client, "GET", "/v1/topics/t/queues/7/messages")
    assert st == 422 and err(res)["field"] == "queue"
    st, res = await req(client, "GET", "/v1/topics/t/queues/0/messages?max_messages=0")
    assert st == 422 and err(res)["field"] == "max_messages"
    st, res = await req(client, "GET", "/v1/topics/t/queues/0/messages?consistency=eventual")
    assert st == 422 and err(res)["field"] == "consistency"
    r = await client.post("/v1/topics/t/messages", data=b"{not json")
    assert r.status == 400 and err(await r.json())["code"] == "BAD_REQUEST"
    big = {"messages": [{"value": "x" * (260 << 10), "encoding": "utf-8"}]}
    st, res = await req(client, "POST", "/v1/topics/t/messages", big)
    assert st == 413, res
    r = await client.post("/v1/topics/t/messages", data=b"x" * (1 << 20))
    assert r.status == 413
    st, res = await req(client, "POST", "/v1/groups/g/offsets", {"offsets": [{"topic": "t"}]})
    assert st == 422 and err(res)["field"] == "offsets[0].queue"
    st, res = await req(
        client,
        "POST",
        "/v1/groups/g/offsets",
        {"offsets": [{"topic": "t", "queue": 0, "offset": 5}]},
    )
    assert st == 416 and err(res)["field"] == "offsets[0].offset"
    st, res = await req(client, "POST", "/v1/groups/g/reset", {"topic": "t", "to": "yesterday"})
    assert st == 422 and err(res)["field"] == "to"


async def test_idempotent_producer_over_http(client: TestClient[Any, Any]) -> None:
    await make_topic(client, "t", 4)
    st, p = await req(client, "POST", "/v1/producers", {})
    assert st == 200 and p["epoch"] == 0
    batch = {
        "producer_id": p["producer_id"],
        "epoch": 0,
        "sequence": 0,
        "messages": [{"value": "a", "encoding": "utf-8", "sharding_key": "k"}],
    }
    st, first = await req(client, "POST", "/v1/topics/t/messages", batch)
    assert st == 200 and first["duplicate"] is False
    st, again = await req(client, "POST", "/v1/topics/t/messages", batch)
    assert st == 200 and again["duplicate"] is True
    assert again["messages"][0]["queue_offset"] == first["messages"][0]["queue_offset"]
    assert again["messages"][0]["duplicate"] is True
    st, res = await req(client, "POST", "/v1/topics/t/messages", {**batch, "sequence": 7})
    assert st == 409 and err(res)["code"] == "SEQUENCE_GAP" and err(res)["expected_sequence"] == 1
    st, p2 = await req(client, "POST", "/v1/producers", {"producer_id": p["producer_id"]})
    assert p2["epoch"] == 1
    st, res = await req(client, "POST", "/v1/topics/t/messages", {**batch, "sequence": 1})
    assert st == 409 and err(res)["code"] == "PRODUCER_FENCED"


async def test_long_poll_wakes_on_new_data_and_times_out_empty(
    client: TestClient[Any, Any],
) -> None:
    await make_topic(client, "t", 1)
    t0 = time.monotonic()
    st, res = await req(client, "GET", "/v1/topics/t/queues/0/messages?offset=0&wait_ms=200")
    assert st == 200 and res["messages"] == [] and time.monotonic() - t0 >= 0.19

    async def produce_later() -> None:
        await asyncio.sleep(0.2)
        st, _ = await req(
            client,
            "POST",
            "/v1/topics/t/messages",
            {"messages": [{"value": "late", "encoding": "utf-8"}]},
        )
        assert st == 200

    task = asyncio.create_task(produce_later())
    t0 = time.monotonic()
    st, res = await req(
        client, "GET", "/v1/topics/t/queues/0/messages?offset=0&wait_ms=10000&encoding=utf-8"
    )
    await task
    assert st == 200 and [m["value"] for m in res["messages"]] == ["late"]
    assert time.monotonic() - t0 < 5


async def test_group_offsets_commit_read_and_reset(client: TestClient[Any, Any]) -> None:
    await make_topic(client, "t", 2)
    for q in (0, 1, 1):
        await req(
            client,
            "POST",
            "/v1/topics/t/messages",
            {"messages": [{"value": "x", "encoding": "utf-8", "queue": q}]},
        )
    offs = {"offsets": [{"topic": "t", "queue": 1, "offset": 2}]}
    st, res = await req(client, "POST", "/v1/groups/g/offsets", offs)
    assert st == 200
    st, res = await req(client, "GET", "/v1/groups/g/offsets")
    assert res["offsets"] == [{"topic": "t", "queue": 1, "offset": 2}]
    st, res = await req(client, "POST", "/v1/groups/g/reset", {"topic": "t", "to": "earliest"})
    assert st == 200
    st, res = await req(client, "GET", "/v1/groups/g/offsets?topic=t")
    assert [o["offset"] for o in res["offsets"]] == [0, 0]
    st, res = await req(client, "POST", "/v1/groups/g/reset", {"topic": "t", "to": "latest"})
    assert [o["offset"] for o in res["offsets"]] == [1, 2]


async def test_cluster_readyz_retention_and_raft_routes_still_work(
    client: TestClient[Any, Any],
) -> None:
    await make_topic(client, "t", 1)
    st, res = await req(client, "GET", "/v1/cluster")
    assert st == 200 and res["role"] == "leader" and res["broker"]["topics"] == 1
    assert res["broker"]["epoch_map"]
    st, res = await req(client, "GET", "/readyz")
    assert st == 200 and res["ready"] is True
    st, res = await req(client, "PUT", "/v1/retention", {"max_bytes": 1000})
    assert st == 200 and res["max_bytes"] == 1000
    st, res = await req(client, "GET", "/raft/applied")
    assert st == 200 and len(res["records"]) >= 2
    r = await client.post("/raft/propose", data=b"raw bytes")
    assert r.status == 200 and isinstance((await r.json())["result"], int)


async def test_openapi_matches_the_router_both_ways_and_is_valid_3_1(
    client: TestClient[Any, Any],
) -> None:
    from openapi_spec_validator import validate

    st, doc = await req(client, "GET", "/openapi.json")
    assert st == 200 and doc["openapi"] == "3.1.0"
    validate(doc)  # the OpenAPI 3.1 meta-schema, JSON Schema 2020-12 for the schemas
    app = client.server.app
    assert app is not None
    routes = {
        (route.method.lower(), route.resource.canonical)
        for route in app.router.routes()
        if route.method not in ("HEAD", "*") and route.resource is not None
    }
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented
    undocumented = [
        (m, p)
        for p, ops in doc["paths"].items()
        for m, op in ops.items()
        if op.get("x-undocumented")
    ]
    assert not undocumented, undocumented
    for p, ops in doc["paths"].items():
        for m, op in ops.items():
            ok = [s for s in op["responses"] if s.startswith("2")]
            assert len(ok) == 1, (m, p)
            assert op["responses"][ok[0]]["content"], (m, p)
            if m in ("post", "put", "patch") and p != "/raft/transfer" and p != "/raft/bench":
                assert "requestBody" in op, (m, p)
            assert "x-required-role" in op, (m, p)
    schemas = doc["components"]["schemas"]
    for name in ["Message", "ProduceRequest", "ProduceResult", "ConsumeResult", "Error", "Topic"]:
        assert name in schemas, name
    consume = doc["paths"]["/v1/topics/{topic}/queues/{queue}/messages"]["get"]
    bounds = {p["name"]: p["schema"] for p in consume["parameters"]}
    # 10000 for an Arrow answer; a JSON one refuses more than 1000 (test_arrow.py)
    assert bounds["max_messages"]["minimum"] == 1 and bounds["max_messages"]["maximum"] == 10_000
    ok = consume["responses"]["200"]
    assert set(ok["content"]) == {"application/json", "application/vnd.apache.arrow.stream"}
    assert "X-Next-Offset" in ok["headers"] and "406" in consume["responses"]
    assert bounds["wait_ms"]["maximum"] == 30_000 and bounds["queue"]["type"] == "integer"


async def test_answers_conform_to_the_document(client: TestClient[Any, Any]) -> None:
    """req() checks every answer; here the checker itself must catch a lie."""
    conf = await conformance(client)
    await make_topic(client, "t", 1)
    _, res = await req(client, "GET", "/v1/topics/t")
    assert conf.checked >= 2
    with pytest.raises(AssertionError, match="not declared"):
        conf.check("GET", "/v1/topics/t", 418, {}, b"{}")
    with pytest.raises(AssertionError, match="does not match"):
        conf.check("GET", "/v1/topics/t", 200, {}, {**res, "name": 5})
    with pytest.raises(AssertionError, match="does not match"):
        conf.check("GET", "/v1/topics/t", 404, {}, {"code": "x"})
    with pytest.raises(AssertionError, match="Retry-After"):
        conf.check("GET", "/v1/topics/t", 503, {}, {"error": {"code": "X", "message": ""}})
    with pytest.raises(AssertionError, match="Location"):
        conf.check("POST", "/v1/topics", 307, {}, b"{}")


async def test_metrics_count_requests_fsyncs_and_elections(client: TestClient[Any, Any]) -> None:
    def sample(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    text0 = await (await client.get("/metrics")).text()
    fsyncs0 = sample(text0, "dledger_fsync_seconds_count")
    assert sample(text0, "dledger_elections_total") >= 1  # the one-node cluster elected itself
    assert sample(text0, "dledger_leader_changes_total") >= 1
    await make_topic(client, "t", 1)
    for _ in range(3):
        st, _ = await req(
            client, "POST", "/v1/topics/t/messages", {"messages": [{"value": "eA=="}]}
        )
        assert st == 200
    await req(client, "GET", "/v1/topics/nope")
    r = await client.get("/metrics")
    text = await r.text()
    assert r.status == 200 and r.content_type == "text/plain"
    assert sample(text, "dledger_fsync_seconds_count") >= fsyncs0 + 4  # each write was fsynced
    assert 'dledger_fsync_seconds_bucket{le="+Inf"}' in text
    assert sample(text, "dledger_commit_index") >= 5
    assert sample(text, "dledger_apply_lag") == 0
    assert sample(text, "dledger_stored_bytes") > 0
    route = 'method="POST",route="/v1/topics/{topic}/messages",status="200"'
    assert f"dledger_http_requests_total{{{route}}} 3" in text
    assert f"dledger_http_request_duration_seconds_count{{{route}}} 3" in text
    assert f'dledger_http_request_duration_seconds_bucket{{{route},le="+Inf"}} 3' in text
    assert 'route="/v1/topics/{topic}",status="404"' in text
    # Histogram buckets are cumulative and end at the count.
    buckets = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dledger_fsync_seconds_bucket")
    ]
    assert buckets == sorted(buckets) and buckets[-1] == sample(text, "dledger_fsync_seconds_count")


async def test_cluster_admin_routes(client: TestClient[Any, Any]) -> None:
    st, res = await req(client, "POST", "/v1/cluster/members", {"op": "nope", "id": 2})
    assert st == 422 and err(res)["field"] == "op"
    st, res = await req(client, "POST", "/v1/cluster/members", {"op": "add_learner", "id": 9})
    assert st == 422 and err(res)["code"] == "UNKNOWN_MEMBER"
    st, res = await req(client, "POST", "/v1/cluster/transfer-leadership", {"to": 2})
    assert st == 409, res


async def test_clients_sync_and_async(client: TestClient[Any, Any]) -> None:
    from http_api.client import ApiError, AsyncClient, Client, OutMessage

    address = f"{client.server.host}:{client.server.port}"
    sync = Client([address], retry_for_s=5)
    await asyncio.to_thread(sync.create_topic, "c", 2)
    p = await asyncio.to_thread(sync.producer)
    acks = await asyncio.to_thread(p.send, "c", [b"a", "b"], None, "key-1")
    assert len({a.queue for a in acks}) == 1 and [a.queue_offset for a in acks] == [0, 1]
    acks2 = await asyncio.to_thread(p.send, "c", [OutMessage(b"c", tags="t")], None, "key-1")
    assert acks2[0].queue_offset == 2 and not acks2[0].duplicate
    batch = await asyncio.to_thread(sync.consume, "c", acks[0].queue, 0)
    assert [r.value for r in batch.records] == [b"a", b"b", b"c"]
    await asyncio.to_thread(sync.commit, "g", {("c", acks[0].queue): 3})
    assert await asyncio.to_thread(sync.offsets, "g") == {("c", acks[0].queue): 3}
    with pytest.raises(ApiError) as ei:
        await asyncio.to_thread(sync.consume, "c", acks[0].queue, 99)
    assert ei.value.status == 416 and ei.value.details["max_offset"] == 3

    async with AsyncClient([address], retry_for_s=5) as ac:
        got = await ac.produce("c", [OutMessage(b"z", queue=0)])
        assert got[0].queue == 0
        b = await ac.consume("c", 0, got[0].queue_offset)
        assert b.records[0].value == b"z"
        await ac.commit("g2", {("c", 0): 1})
        assert await ac.offsets("g2") == {("c", 0): 1}
        with pytest.raises(ApiError) as ei:
            await ac.produce("nope", [b"x"])
        assert ei.value.status == 404 and ei.value.code == "UNKNOWN_TOPIC"
