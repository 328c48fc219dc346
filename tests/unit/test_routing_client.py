"""The routing client's rules, against scripted groups (no processes):
ordered messages keep their queue and fail naming the group; unordered
ones move only when their group surely did not take them; a batch whose
outcome is unknown never moves and is sent again, with its sequence,
before anything else goes to its queue; cached routes outlive the
controller."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import pytest

from http_api.client import ApiError, OutcomeUnknownError, OutMessage, UnavailableError
from http_api.routing import GroupUnavailableError, Route, RoutingClient

Script = Callable[[str, str, Any], Any]


class FakeGroup:
    """Stands in for one group's Client: a tiny broker with per-queue logs
    and idempotent dedup, whose availability the test switches."""

    binary = False  # as the routing client's group clients

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "up"  # up | refuse (surely not done) | lose (done, answer lost) | blackhole
        self.logs: dict[int, list[bytes]] = {}
        self.seqs: dict[tuple[int, int], int] = {}  # (pid, queue) -> next sequence
        self.addresses = [f"{name}:1"]
        self.calls: list[tuple[str, str]] = []

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        safe: bool,
        retry_for_s: float | None = None,
    ) -> Any:
        self.calls.append((method, path))
        if method == "POST" and path == "/v1/producers":
            if self.mode in ("refuse", "blackhole"):
                raise UnavailableError(503, "UNAVAILABLE", "down", {"outcome_unknown": False})
            return {"producer_id": 7, "epoch": 0}
        assert method == "POST" and path.endswith("/messages"), path
        msgs = body["messages"]
        q = msgs[0]["queue"]
        assert all(m["queue"] == q for m in msgs)
        if self.mode == "refuse":
            raise UnavailableError(503, "UNAVAILABLE", "refused", {"outcome_unknown": False})
        if self.mode == "blackhole":
            raise UnavailableError(0, "UNAVAILABLE", "no answer", {"outcome_unknown": True})
        log = self.logs.setdefault(q, [])
        dup = False
        if "sequence" in body:
            key = (body["producer_id"], q)
            nxt = self.seqs.get(key, 0)
            if body["sequence"] < nxt:
                dup = True  # the dedup window answers the first copy
            else:
                assert body["sequence"] == nxt, "sequence gap"
                self.seqs[key] = nxt + len(msgs)
        start = len(log)
        if not dup:
            log.extend(base64.b64decode(m["value"]) for m in msgs)
        if self.mode == "lose":
            self.mode = "blackhole"  # written, but the answer never comes
            if safe:
                raise UnavailableError(0, "UNAVAILABLE", "lost", {"outcome_unknown": True})
            raise OutcomeUnknownError(0, "CONNECTION", "lost", {})
        return {
            "topic": "t",
            "messages": [
                {
                    "queue": q,
                    "queue_offset": start + k,
                    "commit_offset": 0,
                    "msg_id": f"{self.name}-{q}-{start + k}",
                    "duplicate": dup,
                }
                for k in range(len(msgs))
            ],
        }


def make() -> tuple[RoutingClient, dict[str, FakeGroup]]:
    rc = RoutingClient(["seed:1"], route_ttl_s=3600, down_for_s=3600)
    groups = {g: FakeGroup(g) for g in ("g1", "g2", "g3")}
    body = {
        "topic": "t",
        "version": 3,
        "queues": [{"queue": q, "group": f"g{q % 3 + 1}"} for q in range(6)],
        "groups": {g: {"members": [{"http": f"{g}:1"}], "live": True} for g in groups},
    }
    rc._routes["t"] = Route.of(body)
    rc._groups.update(groups)  # type: ignore[arg-type]

    def no_seed(*a: object, **k: object) -> Any:
        raise UnavailableError(0, "UNAVAILABLE", "controller down", {"outcome_unknown": False})

    rc.seeds.request = no_seed  # type: ignore[method-assign]
    return rc, groups


def values(groups: dict[str, FakeGroup]) -> list[bytes]:
    return [v for g in groups.values() for log in g.logs.values() for v in log]


def test_ordered_messages_keep_their_queue_and_name_the_group() -> None:
    rc, groups = make()
    groups["g2"].mode = "refuse"
    with pytest.raises(GroupUnavailableError) as ei:
        rc.producer().send("t", [b"o"], queue=1)  # queue 1 belongs to g2
    assert ei.value.status == 503 and ei.value.details["group"] == "g2"
    assert "g2" in str(ei.value) and values(groups) == []
    with pytest.raises(GroupUnavailableError):
        rc.produce("t", [OutMessage(b"k", queue=4)])


def test_unordered_batches_move_when_the_group_surely_refused_and_never_duplicate() -> None:
    rc, groups = make()
    groups["g2"].mode = "refuse"
    p = rc.producer()
    acks = [p.send("t", [f"u{k}".encode()])[0] for k in range(12)]
    assert all(rc.route("t").owners[a.queue] != "g2" for a in acks)
    assert rc.stats.moved >= 1
    assert sorted(values(groups)) == sorted(f"u{k}".encode() for k in range(12))
    # plain (not idempotent) produce moves the same way
    got = rc.produce("t", [b"x1", b"x2", b"x3"])
    assert len(got) == 3 and all(rc.route("t").owners[a.queue] != "g2" for a in got)


def test_an_unknown_outcome_never_moves_and_is_resolved_with_its_sequence() -> None:
    rc, groups = make()
    p = rc.producer()
    groups["g2"].mode = "lose"  # the next batch to g2 is written, its answer lost
    with pytest.raises(OutcomeUnknownError) as ei:
        p.send("t", [b"doubt"], queue=1)
    assert ei.value.details["group"] == "g2"
    assert ei.value.status == 504  # a 503 would invite a resend (the proxy passes it on)
    assert values(groups).count(b"doubt") == 1  # in g2, not copied anywhere else
    # unordered sends avoid the queue in doubt (and g2, blackholed) meanwhile
    for k in range(6):
        (a,) = p.send("t", [f"m{k}".encode()])
        assert a.queue != 1
    # g2 answers again: the batch in doubt goes first, with its sequence, and
    # the group's dedup answers it, so it is stored once
    groups["g2"].mode = "up"
    rc._down.clear()
    (a,) = p.send("t", [b"after"], queue=1)
    assert groups["g2"].logs[1] == [b"doubt", b"after"]
    assert a.queue_offset == 1
    assert sorted(values(groups)).count(b"doubt") == 1


def test_plain_produce_with_an_unknown_outcome_raises_and_does_not_move() -> None:
    rc, groups = make()
    groups["g1"].mode = "lose"
    with pytest.raises(OutcomeUnknownError):
        rc.produce("t", [OutMessage(b"p", queue=0)])
    assert values(groups) == [b"p"]


def test_cached_routes_outlive_the_controller() -> None:
    rc, _ = make()
    r = rc.route("t", refresh=True)  # the seeds are down: the cache answers
    assert r.version == 3
    with pytest.raises(ApiError) as ei:
        rc.route("other")
    assert ei.value.code == "ROUTE_UNAVAILABLE" and ei.value.status == 503


def test_a_producer_session_the_group_forgot_is_registered_again() -> None:
    rc, groups = make()
    p = rc.producer()
    p.send("t", [b"a"], queue=0)
    g1 = groups["g1"]
    g1.seqs.clear()  # the topic was deleted and made again: sequences restarted
    real = g1.request
    calls = {"n": 0}

    def expired(method: str, path: str, body: Any = None, **kw: Any) -> Any:
        if path.endswith("/messages") and body.get("producer_id") == 7 and calls["n"] == 0:
            calls["n"] += 1
            raise ApiError(409, "UNKNOWN_PRODUCER", "producer 7 is not registered", {})
        return real(method, path, body, **kw)

    g1.request = expired  # type: ignore[method-assign]
    (a,) = p.send("t", [b"b"], queue=0)
    assert g1.logs[0] == [b"a", b"b"] and a.queue_offset == 1
    assert [c for c in g1.calls if c[1] == "/v1/producers"] == [("POST", "/v1/producers")] * 2
