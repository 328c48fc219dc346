"""No request may produce a 500 or a hang: 400 seeded random requests (random
JSON shapes and types, garbage bodies, odd path and query values) on every
route of /openapi.json, against a live 3-node cluster, spread over all nodes."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from dledger.cluster import http_request
from tests.http.apiclient import ApiCluster

pytestmark = pytest.mark.integration

_SCALARS: list[Any] = [None, 0, -1, 2**63, 1.5, "", "x" * 300, "../etc", True, "t", "é", "\x00"]
_KEYS = [
    "name", "queues", "messages", "value", "encoding", "key", "tags", "properties", "queue",
    "sharding_key", "producer_id", "epoch", "sequence", "offsets", "topic", "offset", "to",
    "timestamp_ms", "op", "id", "retention_bytes", "max_age_ms",
]  # fmt: skip


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    if depth > 2 or rng.random() < 0.4:
        return rng.choice([*_SCALARS, [], {}])
    if rng.random() < 0.5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(_KEYS): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_random_requests_never_get_a_5xx_or_hang(
    api_cluster: Callable[..., ApiCluster],
) -> None:
    c = api_cluster(voters=3)
    addrs = [c.http(i) for i in c.ids()]
    spec = http_request(addrs[0], "GET", "/openapi.json", timeout_s=10).json()
    routes = sorted(
        (path, method.upper())
        for path, ops in spec["paths"].items()
        for method in ops
        if "bench" not in path
    )
    assert len(routes) >= 15
    lead = c.http(c.wait_leader(30))
    r = http_request(lead, "POST", "/v1/topics", json.dumps({"name": "t", "queues": 2}).encode())
    assert r.status == 201, r.body
    rng = random.Random(20261122)
    statuses: dict[int, int] = {}
    bad = []
    for _ in range(400):
        path, method = rng.choice(routes)
        p = (
            path.replace("{topic}", rng.choice(["t", "nope", "x" * 200, "%00", "a%20b"]))
            .replace("{queue}", rng.choice(["0", "1", "-1", "99999", "abc"]))
            .replace("{group}", rng.choice(["g", "x" * 300, "%2F"]))
        )
        if rng.random() < 0.5:
            params = rng.sample(
                ["offset", "max_messages", "max_bytes", "wait_ms", "tag", "consistency",
                 "encoding", "topic", "to", "timeout_ms"], 3,
            )  # fmt: skip
            values = ["1", "-5", "abc", "99999999999999999999", "", "linearizable"]
            p += "?" + "&".join(f"{q}={rng.choice(values)}" for q in params)
        body = None
        if method in ("POST", "PUT", "PATCH"):
            body = rng.choice(
                [json.dumps(_random_json(rng)).encode(), b"{", b"\xff\xfe", b"", b"[]", b"null"]
            )
        r = http_request(rng.choice(addrs), method, p, body=body, timeout_s=40)
        statuses[r.status] = statuses.get(r.status, 0) + 1
        if r.status >= 500 and r.status not in (503, 504):
            bad.append((method, p, body, r.status, r.body[:300]))
    assert not bad, bad[:5]
    assert statuses.get(200, 0) > 0 and statuses.get(422, 0) > 0, statuses
    print(f"statuses: {dict(sorted(statuses.items()))}")
