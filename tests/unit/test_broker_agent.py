"""A broker node's ownership rules in a multi-group cluster (no processes):
queues of other groups are refused naming the owner; messages without a
queue get one of the group's own (one for a whole idempotent batch); a
sharding key's queue is fixed by the route's queue count."""

from __future__ import annotations

import zlib
from typing import Any

import orjson

from broker_adapter.codec import BATCH_CONTENT_TYPE
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


class Req(dict[Any, Any]):
    """What the agent reads of a request: its checked body, its Content-Type."""

    def __init__(self, body: Any, content_type: str = "application/json") -> None:
        super().__init__({JSON_BODY: body} if body is not None else {})
        self.content_type = content_type


def route(a: GroupAgent, body: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
    req = Req(body)
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
    req = Req({"messages": [{"value": "a", "queue": 1}]})
    assert a._route_produce(req, "other") is None  # type: ignore[arg-type]
    a.table = None
    assert a._route_produce(req, "t") is None  # type: ignore[arg-type]


def test_a_binary_produce_body_is_415_the_agent_cannot_route_it() -> None:
    """The binary body's records are not routed here: a group's node
    refuses it (the clients then send JSON), with or without a route table."""
    for table in (True, False):
        a = agent()
        if not table:
            a.table = None
        resp = a._route_produce(Req(None, BATCH_CONTENT_TYPE), "t")  # type: ignore[arg-type]
        assert resp is not None and resp.status == 415
        assert resp.body is not None
        err = orjson.loads(resp.body)["error"]  # type: ignore[arg-type]
        assert err["code"] == "UNSUPPORTED_MEDIA_TYPE" and "JSON" in err["message"]
