"""An OpenAPI 3.1 document built from the application's own router, so it
cannot miss a route: every registered (method, path) is listed, with the
path parameters taken from the route and the query parameters and bodies
described in :data:`DESCRIPTIONS` (routes without an entry get a generic one).
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

_PARAM = re.compile(r"{(\w+)}")

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "field": {"type": "string"},
            },
            "additionalProperties": True,
        }
    },
}

_INT = {"type": "integer"}
_STR = {"type": "string"}

# (method, path) -> (summary, query parameters {name: schema}, has JSON body)
DESCRIPTIONS: dict[tuple[str, str], tuple[str, dict[str, dict[str, Any]], bool]] = {
    ("POST", "/v1/topics"): ("Create a topic {name, queues}", {}, True),
    ("GET", "/v1/topics"): ("List topics", {"consistency": _STR}, False),
    ("GET", "/v1/topics/{topic}"): ("Describe a topic", {"consistency": _STR}, False),
    ("PATCH", "/v1/topics/{topic}"): ("Grow a topic's queue count {queues}", {}, True),
    ("DELETE", "/v1/topics/{topic}"): ("Delete a topic", {}, False),
    ("POST", "/v1/topics/{topic}/messages"): (
        "Produce a batch; answers after commit and apply",
        {"timeout_ms": _INT},
        True,
    ),
    ("GET", "/v1/topics/{topic}/queues/{queue}/messages"): (
        "Consume by queue offset (long-poll)",
        {
            "offset": _INT,
            "max_messages": _INT,
            "max_bytes": _INT,
            "wait_ms": _INT,
            "tag": _STR,
            "encoding": _STR,
            "consistency": _STR,
        },
        False,
    ),
    ("POST", "/v1/producers"): ("Register an idempotent producer", {}, True),
    ("GET", "/v1/groups/{group}/offsets"): (
        "Committed consumer offsets",
        {"topic": _STR, "consistency": _STR},
        False,
    ),
    ("POST", "/v1/groups/{group}/offsets"): ("Commit consumer offsets", {}, True),
    ("POST", "/v1/groups/{group}/reset"): ("Reset a group's offsets", {}, True),
    ("PUT", "/v1/retention"): ("Set retention and producer expiry", {}, True),
    ("GET", "/v1/cluster"): ("Node, Raft and broker status", {}, False),
    ("POST", "/v1/cluster/transfer-leadership"): ("Transfer leadership {to}", {}, True),
    ("POST", "/v1/cluster/members"): ("Change membership {op, id}", {}, True),
}


def openapi_document(app: web.Application) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        method = route.method.upper()
        if method in ("HEAD", "*") or route.resource is None:
            continue
        path = route.resource.canonical
        summary, query, has_body = DESCRIPTIONS.get((method, path), (f"{method} {path}", {}, False))
        params: list[dict[str, Any]] = [
            {"name": n, "in": "path", "required": True, "schema": _STR}
            for n in _PARAM.findall(path)
        ]
        params += [
            {"name": n, "in": "query", "required": False, "schema": schema}
            for n, schema in query.items()
        ]
        op: dict[str, Any] = {
            "summary": summary,
            "parameters": params,
            "responses": {
                "200": {"description": "OK"},
                "default": {
                    "description": "error envelope",
                    "content": {"application/json": {"schema": ERROR_SCHEMA}},
                },
            },
        }
        if has_body:
            op["requestBody"] = {
                "required": False,
                "content": {"application/json": {"schema": {"type": "object"}}},
            }
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "DLedger-py", "version": "0.1.0"},
        "paths": dict(sorted(paths.items())),
    }
