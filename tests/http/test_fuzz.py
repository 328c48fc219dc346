"""No request may produce a 500 or a hang, and every answer must be what
/openapi.json says: 400 seeded random requests (random JSON shapes and types,
schema-shaped bodies with one field broken, garbage bodies, odd path and
query values) on every route of the document, against a live 3-node
cluster, spread over all nodes. Each answer's status must be declared for
its operation, its required headers present, and its body must match the
status's schema (tests/http/conformance.py)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from dledger.cluster import http_request
from tests.http.apiclient import ApiCluster
from tests.http.conformance import Conformance, Nonconforming

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


def _from_schema(
    rng: random.Random, schema: dict[str, Any], doc: dict[str, Any], depth: int = 0
) -> Any:
    """A value shaped like ``schema`` (refs followed), sometimes subtly wrong."""
    if "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    if depth > 3 or rng.random() < 0.05:
        return _random_json(rng, 2)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    if "oneOf" in schema:
        return _from_schema(rng, rng.choice(schema["oneOf"]), doc, depth + 1)
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        keys = [k for k in props if k in schema.get("required", []) or rng.random() < 0.5]
        out = {k: _from_schema(rng, props[k], doc, depth + 1) for k in keys}
        if not props and isinstance(schema.get("additionalProperties"), dict):
            out = {"k": _from_schema(rng, schema["additionalProperties"], doc, depth + 1)}
        return out
    if kind == "array":
        return [
            _from_schema(rng, schema.get("items", {}), doc, depth + 1)
            for _ in range(rng.randrange(1, 3))
        ]
    if kind == "integer":
        lo = schema.get("minimum", 0)
        hi = min(schema.get("maximum", lo + 10), lo + 10)
        return rng.randint(lo - 1 if rng.random() < 0.1 else lo, hi)
    if kind == "string":
        if "pattern" in schema:
            return rng.choice(["t", "g", "t2"])
        return rng.choice(["dGV4dA==", "text", "", "k"])
    if kind == "boolean":
        return rng.random() < 0.5
    return _random_json(rng, 2)


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
    conf = Conformance(spec)
    lead = c.http(c.wait_leader(30))
    r = http_request(lead, "POST", "/v1/topics", json.dumps({"name": "t", "queues": 2}).encode())
    assert r.status == 201, r.body
    rng = random.Random(20261122)
    statuses: dict[int, int] = {}
    bad = []
    nonconforming: list[str] = []
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
            op = spec["paths"][path][method.lower()]
            schema = (
                op.get("requestBody", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema")
            )
            if schema is not None and rng.random() < 0.5:
                body = json.dumps(_from_schema(rng, schema, spec)).encode()
            else:
                body = rng.choice(
                    [json.dumps(_random_json(rng)).encode(), b"{", b"\xff\xfe", b"", b"[]", b"null"]
                )
        r = http_request(rng.choice(addrs), method, p, body=body, timeout_s=40)
        statuses[r.status] = statuses.get(r.status, 0) + 1
        if r.status >= 500 and r.status not in (503, 504):
            bad.append((method, p, body, r.status, r.body[:300]))
        try:
            conf.check(method, p, r.status, r.headers, r.body)
        except Nonconforming as exc:
            nonconforming.append(str(exc))
    assert not bad, bad[:5]
    assert not nonconforming, nonconforming[:5]
    assert statuses.get(200, 0) + statuses.get(201, 0) > 20, statuses
    assert statuses.get(422, 0) > 0 and statuses.get(400, 0) > 0, statuses
    assert conf.checked > 300  # most answers came from documented operations
    print(f"statuses: {dict(sorted(statuses.items()))}, {conf.checked} checked against the schemas")
