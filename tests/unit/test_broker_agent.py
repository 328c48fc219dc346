"""A broker node's ownership rules in a multi-group cluster (no processes):
queues of other groups are refused naming the owner; messages without a
queue get one of the group's own (one for a whole idempotent batch); a
sharding key's queue is fixed by the route's queue count."""

from __future__ import annotations

import zlib
from typing import Any

import orjson

from controller import codec
from controller.state import ControllerState
from dledger.core.types import Entry
from dledger_app.broker_agent import GroupAgent
from dledger_app.groups import GroupFile
from http_api.guard import JSON_BODY


def agent(group: str = "g1") -> GroupAgent:
    st = ControllerState()
    for k, g in enumerate(("g1", "g2", "g3")):
        data = codec.heartbeat(
            1000, g, 1, f"127.0.0.1:{7000 + k}", leader=True, term=1, knows_leader=True,
            members=[(1, f"127.0.0.1:{7000 + k}")],
        )  # fmt: skip
        st.apply(Entry(k + 1, 1, data=data))
    st.apply(Entry(4, 1, data=codec.create_topic(1000, "t", 6)))
    a = GroupAgent(None, None, GroupFile(group, "broker", ("127.0.0.1:1",)))  # type: ignore[arg-type]
    a.table = st.table()
    return a


def route(a: GroupAgent, body: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
    req = {JSON_BODY: body}
    resp = a._route_produce(req, "t")  # type: ignore[arg-type]
    if resp is None:
        return None, body
    assert resp.body is not None
    return resp.status, orjson.loads(resp.body)  # type: ignore[arg-type]


def test_a_queue_of_another_group_is_refused_naming_the_owner() -> None:
    status, err = route(agent("g1"), {"messages": [{"value": "a", "queue": 1}]})
    assert status == 421
    assert err["error"]["code"] == "WRONG_GROUP" and err["error"]["group"] == "g2"
    assert err["error"]["field"] == "messages[0].queue"
    assert err["error"]["leader_http"] == "127.0.0.1:7001"


def test_messages_without_a_queue_get_the_groups_own() -> None:
    a = agent("g2")  # owns queues 1 and 4
    status, body = route(a, {"messages": [{"value": str(k)} for k in range(6)]})
    assert status is None
    assert {m["queue"] for m in body["messages"]} == {1, 4}
    status, body = route(a, {"producer_id": 5, "messages": [{"value": "x"}, {"value": "y"}]})
    assert status is None
    qs = {m["queue"] for m in body["messages"]}
    assert len(qs) == 1 and qs <= {1, 4}  # an idempotent batch: one queue


def test_a_sharding_key_is_hashed_over_the_routes_queue_count() -> None:
    key = next(f"k{i}" for i in range(100) if zlib.crc32(f"k{i}".encode()) % 6 == 2)  # g3's
    status, body = route(agent("g3"), {"messages": [{"value": "a", "sharding_key": key}]})
    assert status is None and body["messages"][0]["queue"] == 2
    status, err = route(agent("g1"), {"messages": [{"value": "a", "sharding_key": key}]})
    assert status == 421 and err["error"]["group"] == "g3"


def test_unknown_topics_and_no_table_pass_through() -> None:
    a = agent()
    req = {JSON_BODY: {"messages": [{"value": "a", "queue": 1}]}}
    assert a._route_produce(req, "other") is None  # type: ignore[arg-type]
    a.table = None
    assert a._route_produce(req, "t") is None  # type: ignore[arg-type]
