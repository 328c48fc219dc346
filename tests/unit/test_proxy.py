"""The proxy's answers that need no broker group: refusals name the field
(422), a route nobody can give is a 503 with Retry-After, never a 500."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from dledger.cluster import free_ports
from dledger_app.proxy import Proxy, _api_error
from http_api.client import ApiError, OutcomeUnknownError, UnavailableError
from http_api.routing import RoutingClient


async def _client() -> TestClient:
    (dead,) = free_ports(1)  # nothing listens there: connections are refused
    proxy = Proxy(RoutingClient([f"127.0.0.1:{dead}"], group_retry_s=0.3), workers=2)
    app = proxy.app()
    app.on_cleanup.append(lambda _app: _close(proxy))
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def _close(proxy: Proxy) -> None:
    proxy.close()


async def test_refusals_name_the_field() -> None:
    c = await _client()
    try:
        cases = [
            ({"messages": [{"value": "a"}], "producer_id": 3, "sequence": 0}, "producer_id"),
            ({"messages": []}, "messages"),
            ({"messages": [{"value": "%%%"}]}, "messages[0].value"),
            ({"messages": [{"value": "a", "encoding": "latin-1"}]}, "messages[0].encoding"),
            ({"messages": [{"value": "YQ==", "queue": -1}]}, "messages[0].queue"),
            ({"messages": [{"value": "YQ==", "sharding_key": 5}]}, "messages[0].sharding_key"),
            ({"messages": [{"value": "YQ=="}], "extra": 1}, "extra"),
        ]
        for body, field in cases:
            r = await c.post("/v1/topics/t/messages", json=body)
            j = await r.json()
            assert r.status == 422, (body, j)
            assert j["error"]["field"] == field, (body, j)
        r = await c.post("/v1/topics/t/messages", data=b"not json")
        assert r.status == 422 and (await r.json())["error"]["field"] == "body"
        # the binary body: the proxy routes each message, so it takes JSON only
        binary = {"Content-Type": "application/vnd.dledger.batch"}
        r = await c.post("/v1/topics/t/messages", data=b"DLB1", headers=binary)
        assert r.status == 415 and (await r.json())["error"]["code"] == "UNSUPPORTED_MEDIA_TYPE"
    finally:
        await c.close()


async def test_no_route_is_a_503_with_retry_after() -> None:
    c = await _client()
    try:
        r = await c.get("/v1/routes/t")
        j = await r.json()
        assert r.status == 503 and j["error"]["code"] == "ROUTE_UNAVAILABLE", j
        assert r.headers["Retry-After"]
        r = await c.post("/v1/topics/t/messages", json={"messages": [{"value": "YQ=="}]})
        assert r.status == 503 and (await r.json())["error"]["code"] == "ROUTE_UNAVAILABLE"
        r = await c.get("/v1/groups/g/offsets")
        assert r.status == 422 and (await r.json())["error"]["field"] == "topic"
        r = await c.get("/healthz")
        assert r.status == 200
    finally:
        await c.close()


def test_an_unknown_outcome_is_a_504_never_a_503() -> None:
    """A client sends a 503'd request again; after an unknown outcome that
    would write the message twice (found by the live test: a value in two
    groups)."""
    for exc in (
        OutcomeUnknownError(0, "CONNECTION", "lost", {}),
        OutcomeUnknownError(503, "OUTCOME_UNKNOWN", "maybe", {}),
        UnavailableError(503, "UNAVAILABLE", "maybe", {"outcome_unknown": True}),
    ):
        assert _api_error(exc).status == 504, exc
    sure = UnavailableError(503, "UNAVAILABLE", "refused", {"outcome_unknown": False})
    assert _api_error(sure).status == 503
    assert _api_error(ApiError(0, "UNAVAILABLE", "refused", {})).status == 503
