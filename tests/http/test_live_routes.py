"""Every route of /openapi.json, called for real against a live cluster of
3 voters and 1 learner (separate processes), each answer checked against
the document (ApiCluster.call / raw below). Along the way: a follower
redirects a write with 307, Location and the leader in the body; followers
and the learner refuse linearizable reads (307 to the leader) and serve
committed ones; a long-poll on a follower wakes when new data is applied
there; and /metrics moves (fsync histogram on produce, leader changes and
elections after the leader is killed)."""

from __future__ import annotations

import base64
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import pytest

from dledger.cluster import HttpResult, http_request
from tests.http.apiclient import ApiCluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_every_route_live_with_redirects_consistency_long_poll_and_metrics(
    api_cluster: Callable[..., ApiCluster],
) -> None:
    c = api_cluster(voters=3, learners=1)
    conf = c.conformance()
    assert conf is not None
    documented = {(m.upper(), p) for p, ops in conf.doc["paths"].items() for m in ops}
    hit: set[tuple[str, str]] = set()

    def raw(nid: int, method: str, path: str, body: bytes | None = None) -> HttpResult:
        r = http_request(c.http(nid), method, path, body, timeout_s=15)
        conf.check(method, path, r.status, r.headers, r.body)
        found = conf.operation(method, path)
        if found is not None and 200 <= r.status < 300:
            hit.add((method, found[0]))
        return r

    def call(method: str, path: str, body: Any = None, via: int | None = None) -> Any:
        st, res = c.call(method, path, body, via=via, timeout_s=15)
        assert 200 <= st < 300, (method, path, st, res)
        found = conf.operation(method, path)
        assert found is not None
        hit.add((method, found[0]))
        return res

    leader = c.wait_leader()
    voters = [n for n in c.ids() if n != 4]
    learner = 4
    followers = [n for n in voters if n != leader]

    # -- health, readiness, document, metrics on every node ---------------------
    for nid in c.ids():
        assert raw(nid, "GET", "/healthz").json()["status"] == "ok"
        wait_for(lambda nid=nid: raw(nid, "GET", "/readyz").status == 200, 30, f"{nid} ready")
        assert raw(nid, "GET", "/openapi.json").json()["openapi"] == "3.1.0"
        assert raw(nid, "GET", "/raft/status").json()["id"] == nid
    m0 = {nid: raw(nid, "GET", "/metrics").body.decode() for nid in c.ids()}

    # -- a write to a follower: 307 with Location and the leader in the body ----
    body = b'{"name": "r", "queues": 2}'
    r = raw(followers[0], "POST", "/v1/topics", body)
    assert r.status == 307
    assert r.headers["location"] == f"http://{c.http(leader)}/v1/topics"
    err = r.json()["error"]
    assert (err["code"], err["leader"], err["leader_http"]) == (
        "NOT_LEADER",
        leader,
        c.http(leader),
    )
    r = raw(leader, "POST", urllib.parse.urlsplit(r.headers["location"]).path, body)
    assert r.status == 201 and len(r.json()["queues"]) == 2

    # -- topic admin -----------------------------------------------------------
    assert len(call("PATCH", "/v1/topics/r", {"queues": 3})["queues"]) == 3
    assert [t["name"] for t in call("GET", "/v1/topics")["topics"]] == ["r"]
    assert call("GET", "/v1/topics/r")["queues"][2] == {
        "queue": 2,
        "min_offset": 0,
        "max_offset": 0,
    }

    # -- produce, idempotent retry -----------------------------------------------
    p = call("POST", "/v1/producers", {})
    batch = {
        "producer_id": p["producer_id"],
        "epoch": p["epoch"],
        "sequence": 0,
        "messages": [{"value": "first", "encoding": "utf-8", "queue": 1, "tags": "a"}],
    }
    first = call("POST", "/v1/topics/r/messages", batch)
    again = call("POST", "/v1/topics/r/messages", batch)
    assert again["duplicate"] is True and again["messages"][0]["queue_offset"] == 0
    assert first["messages"][0]["commit_offset"] == again["messages"][0]["commit_offset"]
    m1 = raw(leader, "GET", "/metrics").body.decode()
    assert metric(m1, "dledger_fsync_seconds_count") > metric(
        m0[leader], "dledger_fsync_seconds_count"
    )

    # -- committed reads anywhere; linearizable only on the leader ---------------
    q1 = "/v1/topics/r/queues/1/messages?offset=0&encoding=utf-8"
    for nid in [*followers, learner]:
        wait_for(
            lambda nid=nid: (res := raw(nid, "GET", q1)).status == 200 and res.json()["messages"],
            30,
            f"node {nid} to serve the committed message",
        )
        r = raw(nid, "GET", q1 + "&consistency=linearizable")
        assert r.status == 307, (nid, r.status, r.body)
        assert r.headers["location"] == f"http://{c.http(leader)}{q1}&consistency=linearizable"
        assert r.json()["error"]["leader"] == leader
    r = raw(leader, "GET", q1 + "&consistency=linearizable")
    assert r.status == 200 and [m["value"] for m in r.json()["messages"]] == ["first"]
    assert r.json()["messages"][0]["tags"] == "a"

    # -- a long-poll on a follower wakes when the new message is applied there ---
    answer: dict[str, Any] = {}

    def poll() -> None:
        t0 = time.monotonic()
        r = raw(followers[1], "GET", "/v1/topics/r/queues/1/messages?offset=1&wait_ms=20000")
        answer.update(status=r.status, body=r.json(), took=time.monotonic() - t0)

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "the long-poll returned before any new data"
    produced_at = time.monotonic()
    call("POST", "/v1/topics/r/messages", {"messages": [{"value": base64.b64encode(b"\x01").decode(), "queue": 1}]})  # fmt: skip
    t.join(25)
    assert not t.is_alive()
    assert answer["status"] == 200
    assert [base64.b64decode(m["value"]) for m in answer["body"]["messages"]] == [b"\x01"]
    assert time.monotonic() - produced_at < 10 and answer["took"] < 15  # woke, did not time out
    r = raw(followers[1], "GET", "/v1/topics/r/queues/1/messages?offset=2&wait_ms=300")
    assert r.status == 200 and r.json()["messages"] == [] and r.json()["next_offset"] == 2

    # -- consumer groups --------------------------------------------------------
    call("POST", "/v1/groups/g/offsets", {"offsets": [{"topic": "r", "queue": 1, "offset": 2}]})
    assert call("GET", "/v1/groups/g/offsets?topic=r")["offsets"] == [
        {"topic": "r", "queue": 1, "offset": 2}
    ]
    reset = call("POST", "/v1/groups/g/reset", {"topic": "r", "to": "earliest"})
    assert {o["offset"] for o in reset["offsets"]} == {0}

    # -- retention, cluster status ------------------------------------------------
    assert call("PUT", "/v1/retention", {"max_age_ms": 86_400_000})["max_age_ms"] == 86_400_000
    st = call("GET", "/v1/cluster", via=leader)
    assert st["role"] == "leader" and st["leader"] == leader and st["term"] >= 1
    assert st["config"] == {"voters": voters, "learners": [learner]}
    assert {int(k) for k in st["peers"]} == set(c.ids()) - {leader}
    assert all("lag" in p for p in st["peers"].values())
    assert st["lease_remaining_ms"] >= 0 and st["broker"]["epoch_map"]
    assert st["broker"]["confirm_offset"] > 0 and st["commit"] >= st["applied"] - 0

    # -- operator routes ------------------------------------------------------------
    r = raw(leader, "POST", "/raft/propose", b"operator bytes")
    assert r.status == 200 and r.json()["index"] >= 1
    assert raw(leader, "GET", "/raft/read?consistency=linearizable").json()["consistency"] == (
        "linearizable"
    )
    assert raw(followers[0], "GET", "/raft/read?consistency=linearizable").status == 307
    assert raw(leader, "GET", "/raft/applied?max=5").json()["records"]
    assert raw(leader, "GET", "/raft/messages?max=5").status == 200
    assert raw(leader, "POST", "/raft/bench?n=5&size=10&window=2").status == 200

    # -- membership: promote the learner, then remove it ----------------------------
    cfg = call("POST", "/v1/cluster/members", {"op": "promote", "id": learner})["config"]
    assert cfg == {"voters": [*voters, learner], "learners": []}
    r = raw(leader, "POST", "/raft/members", b'{"op": "remove", "id": 4}')
    assert r.status == 200 and r.json()["config"] == {"voters": voters, "learners": []}

    # -- leadership transfer there and back ------------------------------------------
    target = followers[0]
    res = call("POST", "/v1/cluster/transfer-leadership", {"to": target}, via=leader)
    assert res == {"leader": target, "leader_http": c.http(target)}
    assert c.wait_leader(among=voters) == target
    r = raw(target, "POST", f"/raft/transfer?to={leader}")
    assert r.status == 200 and c.wait_leader(among=voters) == leader
    c.refresh_leader()

    # -- delete ------------------------------------------------------------------------
    assert call("DELETE", "/v1/topics/r") == {"deleted": "r"}
    assert raw(leader, "GET", "/v1/topics/r").status == 404

    missing = documented - hit
    assert not missing, f"documented routes never answered 2xx here: {sorted(missing)}"

    # -- metrics move when the leader is killed ------------------------------------------
    before = {n: raw(n, "GET", "/metrics").body.decode() for n in followers}
    c.kill(leader)
    new = c.wait_leader(among=followers)
    for n in followers:
        after = raw(n, "GET", "/metrics").body.decode()
        assert metric(after, "dledger_leader_changes_total") > metric(
            before[n], "dledger_leader_changes_total"
        ), n
    after = raw(new, "GET", "/metrics").body.decode()
    assert metric(after, "dledger_elections_total") > metric(before[new], "dledger_elections_total")
    assert metric(after, "dledger_is_leader") == 1
    redirects = 'dledger_http_requests_total{method="POST",route="/v1/topics",status="307"} 1'
    assert redirects in before[followers[0]]
