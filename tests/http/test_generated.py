"""Requests generated from /openapi.json (hypothesis): for every operation
of the document, path and query values and bodies drawn from its schemas,
valid ones and near misses (a value just out of bounds, an unknown field or
parameter, a signed, padded, fullwidth or Arabic-Indic number, an unknown
enum value, a wrong type, a body compressed or claimed to be). Every answer
must be below 500, carry a status the operation declares, and an error must
be the envelope of that status (tests/http/conformance.py).

One node in-process, served with the node's connection handling, on a loop
in a background thread so hypothesis drives it synchronously."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dledger.config import NodeConfig
from tests.http.conformance import Conformance
from tests.http.onenode import serve_one_node

# Routes whose valid requests would reshape or load the node for minutes
# (membership, leadership, the in-process benchmark): only near misses.
NEAR_MISS_ONLY = {
    ("POST", "/v1/cluster/members"),
    ("POST", "/raft/members"),
    ("POST", "/v1/cluster/transfer-leadership"),
    ("POST", "/raft/transfer"),
    ("POST", "/raft/bench"),
}
# Query values kept small: they bound how long a request may wait.
SMALL = {"timeout_ms": 2000, "wait_ms": 0, "n": 1}
BAD_DIGITS = ["+1", " 1", "1 ", "\uff11", "\u0661", "-1", "", "1e3", "0x1", "1.0"]


class Served:
    def __init__(self, tmp: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stop: asyncio.Future[None] | None = None
        self.client: TestClient[Any, Any] | None = None
        self.cfg = NodeConfig(
            node_id=1,
            cluster_id="gen",
            raft_host="127.0.0.1",
            raft_port=1,
            http_host="127.0.0.1",
            http_port=2,
            data_dir=str(tmp / "n1"),
            request_timeout_ms=2000,
        )
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(60), "the node did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        async with serve_one_node(self.cfg) as c:
            self.client = c
            self.stop = self.loop.create_future()
            self.ready.set()
            await self.stop

    def call(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        async def go() -> tuple[int, dict[str, str], bytes]:
            assert self.client is not None
            r = await self.client.request(method, url, data=body, headers=headers)
            return r.status, dict(r.headers), await r.read()

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(60)

    def close(self) -> None:
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set_result, None)
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, dict[str, Any]]]:
    s = Served(tmp_path_factory.mktemp("generated"))
    try:
        st_, _, _ = s.call(
            "POST", "/v1/topics", b'{"name":"t"}', {"Content-Type": "application/json"}
        )
        assert st_ == 201
        st_, _, raw = s.call("GET", "/openapi.json", None, {})
        assert st_ == 200
        yield s, json.loads(raw)
    finally:
        s.close()


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def values(doc: dict[str, Any], schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of ``schema``, some valid and some just wrong."""
    s = _resolve(doc, schema)
    wrong = st.sampled_from([None, True, -1, 2**64, 1.5, "", "x", [], {}, "é"])
    if "enum" in s:
        return st.one_of(st.sampled_from(s["enum"]), st.sampled_from(["utf-16", "EARLIEST"]))
    if "const" in s:
        return st.just(s["const"])
    if "oneOf" in s:
        return st.one_of(*[values(doc, x, depth + 1) for x in s["oneOf"]])
    kind = s.get("type")
    if kind == "integer":
        lo, hi = s.get("minimum", 0), s.get("maximum", 2**62)
        return st.one_of(
            st.integers(lo, min(hi, lo + 20)), st.sampled_from([lo - 1, hi + 1, hi]), wrong
        )
    if kind == "string":
        pat = s.get("pattern")
        if pat is not None:
            return st.one_of(
                st.from_regex(r"\A[a-z][a-z0-9_.-]{0,8}\Z"),
                st.sampled_from([".", "..", "a b", "é", "x" * 200, "t"]),
            )
        return st.one_of(st.text(max_size=12), st.sampled_from(["AA==", "!!"]))
    if kind == "array":
        item = s.get("items", {})
        return st.one_of(st.lists(values(doc, item, depth + 1), min_size=0, max_size=3), wrong)
    if kind == "object" and depth < 4:
        props = s.get("properties", {})
        required = s.get("required", [])
        if not props and isinstance(s.get("additionalProperties"), dict):
            return st.dictionaries(
                st.text(max_size=5), values(doc, s["additionalProperties"], depth + 1), max_size=3
            )

        @st.composite
        def obj(draw: st.DrawFn) -> dict[str, Any]:
            out = {}
            for k, sub in props.items():
                if k in required or draw(st.booleans()):
                    out[k] = draw(values(doc, sub, depth + 1))
            if draw(st.integers(0, 9)) == 0:
                out[draw(st.sampled_from(["encodng", "extra", "Value"]))] = 1
            if required and draw(st.integers(0, 9)) == 0:
                out.pop(draw(st.sampled_from(required)), None)
            return out

        return st.one_of(obj(), wrong)
    return wrong


def query_value(doc: dict[str, Any], name: str, schema: dict[str, Any]) -> st.SearchStrategy[str]:
    s = _resolve(doc, schema)
    if s.get("type") == "integer":
        lo, hi = s.get("minimum", 0), s.get("maximum", 2**62)
        ok = SMALL.get(name, lo)
        return st.one_of(
            st.just(str(ok)),
            st.sampled_from([str(lo - 1), str(hi + 1)]),
            st.sampled_from(BAD_DIGITS),
        )
    if "enum" in s:
        return st.sampled_from([*s["enum"], "utf-16", "strong", ""])
    if s.get("type") == "number":
        return st.sampled_from(["1", "1.5", "+1", "nan", "inf", ""])
    return st.one_of(st.just("t"), st.sampled_from(["..", "é", "", "a b"]))


@st.composite
def requests(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[str, str, bytes | None, dict[str, str]]:
    ops = sorted((m.upper(), p, op) for p, item in doc["paths"].items() for m, op in item.items())
    method, path, op = draw(st.sampled_from(ops))
    near_miss_only = (method, path) in NEAR_MISS_ONLY
    url = path
    query: list[tuple[str, str]] = []
    for prm in op.get("parameters", []):
        name = prm["name"]
        if prm["in"] == "path":
            if name == "queue":
                v = draw(
                    st.one_of(
                        st.sampled_from(["0", "1", "1023", "1024"]), st.sampled_from(BAD_DIGITS[:6])
                    )
                )
            else:
                v = draw(st.sampled_from(["t", "g", "nope", "..x", "%25", "é"]))
            url = url.replace("{" + name + "}", _quote(v))
        elif prm.get("required") or draw(st.booleans()):
            value = draw(query_value(doc, name, prm["schema"]))
            if near_miss_only and value.isdigit() and name != "timeout_ms":
                value = "-" + value
            query.append((name, value))
    if draw(st.integers(0, 9)) == 0:
        query.append(("unknown_param", "1"))
    if query:
        url += "?" + "&".join(f"{_quote(k)}={_quote(v)}" for k, v in query)
    body: bytes | None = None
    headers: dict[str, str] = {}
    content = op.get("requestBody", {}).get("content", {})
    if "application/json" in content:
        value = draw(values(doc, content["application/json"]["schema"]))
        if near_miss_only and isinstance(value, dict):
            value["near_miss"] = True
        body = json.dumps(value).encode()
        headers["Content-Type"] = "application/json"
        enc = draw(st.sampled_from([None, None, None, "gzip", "gzip-lie", "br"]))
        if enc == "gzip":
            body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        elif enc == "gzip-lie":
            headers["Content-Encoding"] = "gzip"
        elif enc == "br":
            headers["Content-Encoding"] = "br"
    elif "application/octet-stream" in content:
        body = draw(st.binary(max_size=64))
    return method, url, body, headers


def _quote(s: str) -> str:
    import urllib.parse

    return urllib.parse.quote(s, safe="")


def test_generated_requests_conform(served: tuple[Served, dict[str, Any]]) -> None:
    s, doc = served
    conf = Conformance(doc)
    seen: dict[int, int] = {}

    @settings(
        max_examples=400,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        database=None,
    )
    @given(req=requests(doc))
    def run(req: tuple[str, str, bytes | None, dict[str, str]]) -> None:
        method, url, body, headers = req
        status, resp_headers, raw = s.call(method, url, body, headers)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (method, url, body, status, raw[:300])
        if status >= 400:
            err = json.loads(raw)
            assert set(err) == {"error"} and {"code", "message"} <= set(err["error"]), raw
        conf.check(method, url, status, {k.lower(): v for k, v in resp_headers.items()}, raw)

    run()
    print("statuses seen:", dict(sorted(seen.items())))
    assert seen.get(422, 0) > 0 and any(200 <= k < 300 for k in seen), seen
