"""Bearer tokens and roles on the HTTP API.

In-process (one real Node, LMDB in tmp_path): every registered route has an
explicit role, and the full matrix route x {no token, bad token, produce,
consume, admin} gives 401 / 403 / through exactly as the table says. Live (a
3-node cluster started from a cluster file with [[auth.tokens]]): the
Python client with a token (argument or DLEDGER_TOKEN) produces through a
follower's redirect and consumes; the wrong role is refused; operator tools
still find the leader."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from dledger.cluster import http_request
from dledger.config import AuthSpec, TokenSpec
from dledger.http_auth import ROUTE_ROLES
from tests.http.apiclient import ApiCluster
from tests.http.onenode import one_node_config, serve_one_node

PRODUCE = "produce-token-0123456789"
CONSUME = "consume-token-0123456789"
ADMIN = "admin-token-0123456789ab"
BOTH = "produce-and-consume-token"
AUTH = AuthSpec(
    (
        TokenSpec("producer", PRODUCE, ("produce",)),
        TokenSpec("consumer", CONSUME, ("consume",)),
        TokenSpec("ops", ADMIN, ("admin",)),
        TokenSpec("app", BOTH, ("produce", "consume")),
    )
)
TOKENS = {"produce": PRODUCE, "consume": CONSUME, "admin": ADMIN}


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    cfg = one_node_config(tmp_path, "auth", auth=AUTH)
    async with serve_one_node(cfg) as c:
        yield c


def _routes(c: TestClient[Any, Any]) -> list[tuple[str, str]]:
    app = c.server.app
    assert app is not None
    return sorted(
        {
            (r.method, r.resource.canonical)
            for r in app.router.routes()
            if r.method not in ("HEAD", "*") and r.resource is not None
        }
    )


async def test_every_route_declares_a_role(client: TestClient[Any, Any]) -> None:
    app = client.server.app
    assert app is not None
    table = app[ROUTE_ROLES]
    routes = _routes(client)
    assert len(routes) >= 25
    missing = [r for r in routes if r not in table]
    assert not missing, f"routes without an explicit role: {missing}"
    assert table[("POST", "/v1/topics/{topic}/messages")] == "produce"
    assert table[("POST", "/v1/producers")] == "produce"
    for k in [
        ("GET", "/v1/topics/{topic}/queues/{queue}/messages"),
        ("GET", "/v1/groups/{group}/offsets"),
        ("POST", "/v1/groups/{group}/offsets"),
        ("POST", "/v1/groups/{group}/reset"),
    ]:
        assert table[k] == "consume", k
    for k in [
        ("POST", "/v1/topics"),
        ("DELETE", "/v1/topics/{topic}"),
        ("PUT", "/v1/retention"),
        ("POST", "/v1/cluster/transfer-leadership"),
        ("POST", "/v1/cluster/members"),
        ("POST", "/raft/propose"),
    ]:
        assert table[k] == "admin", k


async def test_role_matrix_on_every_route(client: TestClient[Any, Any]) -> None:
    app = client.server.app
    assert app is not None
    table = app[ROUTE_ROLES]
    public = set(AUTH.public)
    checked = 0
    for method, path in _routes(client):
        # ?n=0 keeps /raft/bench from running; other routes ignore it or
        # refuse it, and an empty JSON list body is refused by every writer.
        url = path.replace("{topic}", "t").replace("{queue}", "0").replace("{group}", "g") + "?n=0"
        need = "public" if method == "GET" and path in public else table[(method, path)]
        body = b"[]" if method in ("POST", "PUT", "PATCH") else None

        async def call(
            token: str | None, url: str = url, method: str = method, body: bytes | None = body
        ) -> Any:
            h = {"Authorization": f"Bearer {token}"} if token else {}
            return await client.request(method, url, data=body, headers=h)

        r = await call(None)
        if need == "public":
            assert r.status not in (401, 403), (method, path, r.status)
            continue
        checked += 1
        assert r.status == 401, (method, path, r.status)
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await r.json())["error"]["code"] == "UNAUTHORIZED"
        r = await call("not-a-configured-token")
        assert r.status == 401 and 'error="invalid_token"' in r.headers["WWW-Authenticate"]
        for role, token in TOKENS.items():
            r = await call(token)
            allowed = need == "any" or role in (need, "admin")
            if allowed:
                assert r.status not in (401, 403), (method, path, role, r.status)
            else:
                assert r.status == 403, (method, path, role, r.status)
                e = (await r.json())["error"]
                assert e["code"] == "FORBIDDEN" and e["required_role"] == need
    assert checked >= 20


async def test_malformed_headers_and_unknown_paths(client: TestClient[Any, Any]) -> None:
    for header in ["Basic dXNlcjpwYXNz", "Bearer", "Bearer ", PRODUCE, f"Bearer {PRODUCE}x"]:
        r = await client.get("/v1/topics", headers={"Authorization": header})
        assert r.status == 401, header
    r = await client.get("/v1/topics", headers={"Authorization": f"bearer {PRODUCE}"})
    assert r.status == 200  # the scheme is case-insensitive (RFC 7235)
    r = await client.get("/v1/no-such-route")
    assert r.status == 401  # the route list is not probed without a token
    r = await client.get("/v1/no-such-route", headers={"Authorization": f"Bearer {CONSUME}"})
    assert r.status == 404
    # A token with two roles gets both; the refusals show in the metrics.
    st = await client.post(
        "/v1/topics", json={"name": "t", "queues": 1}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert st.status == 201
    h = {"Authorization": f"Bearer {BOTH}"}
    r = await client.post(
        "/v1/topics/t/messages", json={"messages": [{"value": "eA=="}]}, headers=h
    )
    assert r.status == 200
    r = await client.get("/v1/topics/t/queues/0/messages", headers=h)
    assert r.status == 200 and len((await r.json())["messages"]) == 1
    text = await (await client.get("/metrics")).text()
    assert 'route="/v1/topics",status="401"' in text
    assert 'route="<unmatched>",status="404"' in text


@pytest.mark.integration
def test_live_cluster_with_tokens(
    api_cluster: Callable[..., ApiCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    from http_api.client import AuthenticationError, Client, PermissionDeniedError

    c = api_cluster(voters=3, auth=AUTH)  # wait_leader used the file's admin token
    addrs = [c.http(n) for n in c.ids()]
    leader = c.wait_leader()
    follower = next(n for n in c.ids() if n != leader)
    r = http_request(c.http(follower), "GET", "/raft/status")
    assert r.status == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert http_request(c.http(follower), "GET", "/healthz").status == 200
    assert http_request(c.http(follower), "GET", "/metrics").status == 200

    admin = Client([c.http(follower)], token=ADMIN)
    admin.create_topic("secure", 2)  # through the follower's 307: the header goes along
    monkeypatch.setenv("DLEDGER_TOKEN", PRODUCE)
    producer = Client([c.http(follower), *addrs])  # token from the environment
    acks = producer.produce("secure", [b"one", b"two"])
    assert len(acks) == 2
    p = producer.producer()
    assert p.send("secure", [b"three"], queue=0)[0].queue == 0
    with pytest.raises(PermissionDeniedError) as ei:
        producer.consume("secure", 0, 0)
    assert ei.value.status == 403 and ei.value.code == "FORBIDDEN"
    monkeypatch.delenv("DLEDGER_TOKEN")
    with pytest.raises(AuthenticationError):
        Client(addrs).produce("secure", [b"x"])
    with pytest.raises(AuthenticationError):
        Client(addrs, token="wrong-token-wrong-token").topics()

    consumer = Client(addrs, token=CONSUME)
    values = sorted(
        r.value for q in (0, 1) for r in consumer.consume("secure", q, 0, wait_ms=0).records
    )
    assert values == [b"one", b"three", b"two"]
    consumer.commit("g", {("secure", 0): 1})
    assert consumer.offsets("g") == {("secure", 0): 1}
    with pytest.raises(PermissionDeniedError):
        consumer.create_topic("nope", 1)
    with pytest.raises(PermissionDeniedError):
        consumer.produce("secure", [b"x"])
