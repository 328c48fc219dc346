"""The OpenAPI 3.1 document, built from the application's own router so it
cannot miss a route: every registered (method, path) is listed. What a
route takes and answers (parameters with types and bounds, the request
body, a schema per response status) comes from :data:`OPERATIONS`; a route
without an entry is still listed, marked ``x-undocumented`` (a test keeps
that list empty). Schemas are JSON Schema 2020-12, as OpenAPI 3.1 uses them;
tests validate live answers against them.

The document is the contract the fuzz test holds the server to: an answer's
status must be one the operation declares, and its body must match that
status's schema.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from broker_adapter.codec import BATCH_CONTENT_TYPE, DEFAULT_LIMITS, MAX_QUEUES, NAME_MAX_LEN
from http_api.arrow import ARROW_MAX_MESSAGES, ARROW_STREAM, JSON_MAX_MESSAGES
from http_api.arrow import COLUMNS as ARROW_COLUMNS

_PARAM = re.compile(r"{(\w+)}")
MAX_KEYS = DEFAULT_LIMITS.max_keys  # keys (and tags) of one message
U62 = (1 << 62) - 1


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _int(lo: int | None = None, hi: int | None = None) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _obj(required: list[str], props: dict[str, Any], extra: bool = False) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "properties": props,
        "additionalProperties": extra,
    }


_STR: dict[str, Any] = {"type": "string"}
_BOOL: dict[str, Any] = {"type": "boolean"}
_NAME: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": NAME_MAX_LEN,
    "pattern": "^[A-Za-z0-9_.%|-]+$",
}
# A new topic's name: also not "." or ".." (a URL cannot address those).
_NEW_NAME: dict[str, Any] = {**_NAME, "pattern": r"^(?!\.\.?$)[A-Za-z0-9_.%|-]+$"}
_STR_OR_NULL: dict[str, Any] = {"type": ["string", "null"]}
_INT_OR_NULL: dict[str, Any] = {"type": ["integer", "null"]}

SCHEMAS: dict[str, dict[str, Any]] = {
    "Name": _NAME,
    # -- errors -------------------------------------------------------------
    "Error": _obj(
        ["error"],
        {
            "error": _obj(
                ["code", "message"],
                {
                    "code": {"type": "string", "pattern": "^[A-Z0-9_]+$"},
                    "message": _STR,
                    "field": {"type": "string", "description": "the request field at fault"},
                },
                extra=True,
            )
        },
    ),
    "NotLeaderError": _obj(
        ["error"],
        {
            "error": _obj(
                ["code", "message", "leader", "leader_http"],
                {
                    "code": {"const": "NOT_LEADER"},
                    "message": _STR,
                    "leader": _int(1),
                    "leader_http": _STR,
                },
            )
        },
    ),
    # -- messages -----------------------------------------------------------
    "MessageIn": _obj(
        ["value"],
        {
            "value": {"type": "string", "description": "base64, or UTF-8 text (see encoding)"},
            "encoding": {"enum": ["base64", "utf-8"], "default": "base64"},
            "key": _STR,
            "keys": {"type": "array", "items": _STR},
            "tags": {"oneOf": [_STR, {"type": "array", "items": _STR}]},
            "tag": _STR,
            "properties": {"type": "object", "additionalProperties": _STR},
            "queue": _int(0, MAX_QUEUES - 1),
            "sharding_key": _STR,
            "born_ts_ms": _int(0, U62),
        },
    ),
    "ProduceRequest": _obj(
        ["messages"],
        {
            "messages": {"type": "array", "minItems": 1, "items": _ref("MessageIn")},
            "producer_id": _int(0, (1 << 64) - 1),
            "epoch": _int(0, (1 << 32) - 1),
            "sequence": _int(0, U62),
        },
    ),
    "ProducedMessage": _obj(
        ["queue", "queue_offset", "commit_offset", "size", "msg_id", "duplicate"],
        {
            "queue": _int(0),
            "queue_offset": _int(0),
            "commit_offset": _int(0),
            "size": _int(0),
            "msg_id": _STR,
            "duplicate": _BOOL,
        },
    ),
    "ProduceResult": _obj(
        ["topic", "duplicate", "store_ts_ms", "messages"],
        {
            "topic": _NAME,
            "duplicate": _BOOL,
            "store_ts_ms": _int(0),
            "messages": {"type": "array", "items": _ref("ProducedMessage")},
        },
    ),
    "Message": _obj(
        [
            "queue_offset",
            "commit_offset",
            "size",
            "msg_id",
            "store_ts_ms",
            "born_ts_ms",
            "tags",
            "keys",
            "properties",
            "value",
            "encoding",
        ],
        {
            "queue_offset": _int(0),
            "commit_offset": _int(0),
            "size": _int(0),
            "msg_id": _STR,
            "store_ts_ms": _int(0),
            "born_ts_ms": _int(0),
            "tags": _STR,
            "keys": {"type": "array", "items": _STR},
            "properties": {"type": "object", "additionalProperties": _STR},
            "value": _STR,
            "encoding": {"enum": ["base64", "utf-8"]},
        },
    ),
    "ConsumeResult": _obj(
        ["messages", "next_offset", "min_offset", "max_offset", "confirm_offset"],
        {
            "messages": {"type": "array", "items": _ref("Message")},
            "next_offset": _int(0),
            "min_offset": _int(0),
            "max_offset": _int(0),
            "confirm_offset": _int(0),
        },
    ),
    "ProducerRequest": _obj([], {"producer_id": _int(1, (1 << 64) - 1)}),
    "Producer": _obj(["producer_id", "epoch"], {"producer_id": _int(1), "epoch": _int(0)}),
    # -- topics -------------------------------------------------------------
    "CreateTopicRequest": _obj(
        ["name"], {"name": _NEW_NAME, "queues": {**_int(1, MAX_QUEUES), "default": 8}}
    ),
    "UpdateTopicRequest": _obj(["queues"], {"queues": _int(1, MAX_QUEUES)}),
    "QueueInfo": _obj(
        ["queue", "min_offset", "max_offset"],
        {"queue": _int(0), "min_offset": _int(0), "max_offset": _int(0)},
    ),
    "Topic": _obj(
        ["name", "queues"],
        {"name": _NAME, "queues": {"type": "array", "items": _ref("QueueInfo")}},
    ),
    "TopicList": _obj(["topics"], {"topics": {"type": "array", "items": _ref("Topic")}}),
    "Deleted": _obj(["deleted"], {"deleted": _NAME}),
    # -- groups ---------------------------------------------------------------
    "GroupOffset": _obj(
        ["topic", "queue", "offset"],
        {"topic": _NAME, "queue": _int(0, MAX_QUEUES - 1), "offset": _int(0, U62)},
    ),
    "CommitOffsetsRequest": _obj(
        ["offsets"], {"offsets": {"type": "array", "minItems": 1, "items": _ref("GroupOffset")}}
    ),
    "Offsets": _obj(
        ["group", "offsets"],
        {"group": _NAME, "offsets": {"type": "array", "items": _ref("GroupOffset")}},
    ),
    "ResetRequest": _obj(
        ["topic"],
        {
            "topic": _NAME,
            "to": {"enum": ["earliest", "latest", "timestamp"], "default": "earliest"},
            "timestamp_ms": _int(0, U62),
        },
    ),
    # -- retention and cluster ------------------------------------------------
    "Retention": _obj(
        ["max_bytes", "max_age_ms", "producer_idle_ms"],
        {"max_bytes": _int(0), "max_age_ms": _int(0), "producer_idle_ms": _int(0)},
    ),
    "RetentionRequest": _obj(
        [],
        {"max_bytes": _int(0, U62), "max_age_ms": _int(0, U62), "producer_idle_ms": _int(0, U62)},
    ),
    "RaftStatus": _obj(
        ["id", "cluster_id", "running"],
        {
            "id": _int(1),
            "cluster_id": _STR,
            "running": _BOOL,
            "role": {"enum": ["follower", "pre_candidate", "candidate", "leader", "learner"]},
            "term": _int(0),
            "leader": _int(0),
            "leader_http": _STR_OR_NULL,
            "commit": _int(0),
            "applied": _int(0),
            "last_index": _int(0),
            "lease_remaining_ms": _int(0),
            "config": _obj(
                ["voters", "learners"],
                {
                    "voters": {"type": "array", "items": _int(1)},
                    "learners": {"type": "array", "items": _int(1)},
                },
            ),
            "peers": {"type": "object", "additionalProperties": {"type": "object"}},
            "epochs": {"type": "object", "additionalProperties": _int(0)},
        },
        extra=True,
    ),
    "ClusterStatus": {
        "allOf": [
            _ref("RaftStatus"),
            {
                "type": "object",
                "required": ["role", "term", "leader", "commit", "applied", "peers", "broker"],
                "properties": {
                    "broker": _obj(
                        [
                            "confirm_offset",
                            "topics",
                            "stored_messages",
                            "stored_bytes",
                            "epoch_map",
                        ],
                        {
                            "confirm_offset": _int(0),
                            "topics": _int(0),
                            "stored_messages": _int(0),
                            "stored_bytes": _int(0),
                            "epoch_map": {"type": "object", "additionalProperties": _int(0)},
                        },
                        extra=True,
                    )
                },
            },
        ]
    },
    "TransferRequest": _obj(["to"], {"to": _int(1, (1 << 31) - 1)}),
    "Transfer": _obj(["leader", "leader_http"], {"leader": _int(1), "leader_http": _STR_OR_NULL}),
    "MembersRequest": _obj(
        ["op", "id"],
        {"op": {"enum": ["add_learner", "promote", "remove"]}, "id": _int(1, (1 << 31) - 1)},
    ),
    "Membership": _obj(
        ["config"],
        {
            "config": _obj(
                ["voters", "learners"],
                {
                    "voters": {"type": "array", "items": _int(1)},
                    "learners": {"type": "array", "items": _int(1)},
                },
            )
        },
    ),
    "Ready": _obj(
        ["ready", "role", "leader", "lag"],
        {"ready": {"const": True}, "role": _STR, "leader": _int(1), "lag": _int()},
    ),
    "Health": _obj(
        ["status", "id", "role", "leader"],
        {
            "status": {"enum": ["ok", "failed"]},
            "id": _int(1),
            "role": _STR,
            "leader": _int(0),
            "error": _STR,
        },
    ),
    # -- operator routes (/raft/*) ------------------------------------------
    "Proposed": _obj(
        ["index", "term", "result"], {"index": _int(1), "term": _int(1), "result": {}}
    ),
    "ReadBarrier": _obj(
        ["consistency", "index", "applied", "mode"],
        {
            "consistency": {"enum": ["committed", "linearizable"]},
            "index": _int(0),
            "applied": _int(0),
            "mode": {},
        },
    ),
    "AppliedRecords": _obj(
        ["id", "applied", "records", "next"],
        {"id": _int(1), "applied": _int(0), "records": {"type": "array"}, "next": _INT_OR_NULL},
    ),
    "AppliedMessages": _obj(
        ["id", "applied", "messages"],
        {
            "id": _int(1),
            "applied": _int(0),
            "messages": {
                "type": "array",
                "items": _obj(
                    ["index", "term"],
                    {"index": _int(1), "term": _int(0), "text": _STR, "base64": _STR},
                ),
            },
        },
    ),
    "BenchResult": {"type": "object"},
    "OpenApiDocument": _obj(["openapi", "info", "paths"], {"openapi": _STR}, extra=True),
}

_ARROW_TEXT = (
    "Sent when Accept names this type: an Arrow IPC stream of one record batch, the "
    "messages the JSON answer would carry, columns "
    + ", ".join(f"{name} ({kind})" for name, kind, _ in ARROW_COLUMNS)
    + f"; max_messages may go up to {ARROW_MAX_MESSAGES} (still bounded by max_bytes). The "
    "page's offsets are in the X-*-Offset headers. Errors stay JSON. 406 when the node "
    "lacks pyarrow."
)
_ARROW_HEADERS = {
    "X-Next-Offset": "Arrow answers: the queue offset to ask for next (JSON: next_offset)",
    "X-Min-Offset": "Arrow answers: the queue's first retained offset (JSON: min_offset)",
    "X-Max-Offset": "Arrow answers: one past the queue's last offset (JSON: max_offset)",
    "X-Confirm-Offset": "Arrow answers: this node's confirm offset (JSON: confirm_offset)",
    "X-Message-Count": "Arrow answers: rows in the stream",
}

_Q_CONSISTENCY: dict[str, Any] = {
    "enum": ["committed", "linearizable"],
    "default": "committed",
}
_Q_TIMEOUT = _int(1, 600_000)

BATCH_LAYOUT = f"""\
A JSON ProduceRequest (application/json), or the same batch in binary
({BATCH_CONTENT_TYPE}): no JSON to parse and no base64, the records are
proposed as they are (what the Python client sends). Big-endian:

    magic        4 bytes  "DLB1"
    producer_id  u64      0 = not idempotent
    epoch        u32
    sequence     i64      first message's sequence; -1 = not idempotent
    count        u32      records that follow (1..max_batch_messages)
    count records, back to back, nothing after them:
      length     u32      whole record, this field included
      crc        u32      CRC-32 (zlib, ISO-HDLC) of bytes [8:length]
      version    u8       1
      born_ts_ms i64      producer's timestamp, 0..2^62-1 (the client's clock)
      queue      i32      -1 = the broker chooses, else 0..{MAX_QUEUES - 1}
      sharding   u16 length + UTF-8   "" = none
      tags       u16 length + UTF-8   "" = none
      keys       u16 count, each u16 length + UTF-8
      properties u16 count, each (u16 length + UTF-8 key, u16 length + UTF-8
                 value), sorted by key, each key once
      value      u32 length + bytes

The JSON body's caps hold (strings, keys, properties, value size, batch
size). A record that fails its CRC or its layout is a 422 naming
messages[k]; nothing of the batch is proposed. A broker-group node (behind
the proxy) answers 415 UNSUPPORTED_MEDIA_TYPE: send JSON there.
"""

# Error statuses: where each can come from.
# auth (when on), overload, stopped/no leader, and what the HTTP edge refuses
# on any route: a malformed request or body encoding (400), a body that is
# late (408), too large (413) or in an unsupported Content-Encoding (415).
_EDGE = (400, 408, 413, 415)
_ALWAYS = (401, 403, 429, 503, *_EDGE)
_BODY = (400, 413, 422)  # routes that read a JSON body
_WRITE = (307, 409, 504)  # through the log on the leader: redirect, conflict, unknown outcome
_READ = (307, 422, 504)  # consistency=linearizable may redirect or time out


@dataclass(frozen=True, slots=True)
class Op:
    summary: str
    ok: tuple[int, str]  # success status and its schema name
    query: dict[str, dict[str, Any]] = field(default_factory=dict)
    body: str | None = None  # request schema name
    errors: tuple[int, ...] = ()
    content: str = "application/json"
    path_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[int, str] = field(default_factory=dict)  # other non-error answers
    required: tuple[str, ...] = ()  # query parameters that must be given
    # other media types of the success answer (chosen by Accept): type -> description
    alt_content: dict[str, str] = field(default_factory=dict)
    ok_headers: dict[str, str] = field(default_factory=dict)  # success headers (not required)
    # other media types of the request body (by Content-Type): type -> description
    body_alt: dict[str, str] = field(default_factory=dict)


OPERATIONS: dict[tuple[str, str], Op] = {
    ("POST", "/v1/topics"): Op(
        "Create a topic", (201, "Topic"), {"timeout_ms": _Q_TIMEOUT}, "CreateTopicRequest",
        (*_BODY, *_WRITE),
    ),
    ("GET", "/v1/topics"): Op(
        "List topics", (200, "TopicList"),
        {"consistency": _Q_CONSISTENCY, "timeout_ms": _Q_TIMEOUT}, None, _READ,
    ),
    ("GET", "/v1/topics/{topic}"): Op(
        "Describe a topic: its queues and their offsets", (200, "Topic"),
        {"consistency": _Q_CONSISTENCY, "timeout_ms": _Q_TIMEOUT}, None, (404, *_READ),
    ),
    ("PATCH", "/v1/topics/{topic}"): Op(
        "Grow a topic's queue count", (200, "Topic"), {"timeout_ms": _Q_TIMEOUT},
        "UpdateTopicRequest", (404, *_BODY, *_WRITE),
    ),
    ("DELETE", "/v1/topics/{topic}"): Op(
        "Delete a topic", (200, "Deleted"), {"timeout_ms": _Q_TIMEOUT}, None,
        (404, 422, *_WRITE),
    ),
    ("POST", "/v1/topics/{topic}/messages"): Op(
        "Produce a batch; answers after commit and apply", (200, "ProduceResult"),
        {"timeout_ms": _Q_TIMEOUT}, "ProduceRequest", (404, *_BODY, *_WRITE),
        body_alt={BATCH_CONTENT_TYPE: BATCH_LAYOUT},
    ),
    ("GET", "/v1/topics/{topic}/queues/{queue}/messages"): Op(
        "Consume by queue offset (long-poll: empty list after wait_ms)", (200, "ConsumeResult"),
        {
            "offset": _int(0, U62),
            "max_messages": {
                **_int(1, ARROW_MAX_MESSAGES),
                "default": 32,
                "description": f"at most {JSON_MAX_MESSAGES} for a JSON answer (422 above), "
                f"{ARROW_MAX_MESSAGES} for an Arrow one",
            },
            "max_bytes": {**_int(1, 8 << 20), "default": 1 << 20},
            "wait_ms": {**_int(0, 30_000), "default": 0},
            "tag": _STR,
            "encoding": {"enum": ["base64", "utf-8"], "default": "base64"},
            "consistency": _Q_CONSISTENCY,
            "timeout_ms": _Q_TIMEOUT,
        },
        None, (404, 406, 416, *_READ),
        path_schemas={"queue": _int(0, MAX_QUEUES - 1)},
        alt_content={ARROW_STREAM: _ARROW_TEXT},
        ok_headers=_ARROW_HEADERS,
    ),
    ("POST", "/v1/producers"): Op(
        "Register (or re-register, fencing the old epoch) an idempotent producer",
        (200, "Producer"), {"timeout_ms": _Q_TIMEOUT}, "ProducerRequest", (*_BODY, *_WRITE),
    ),
    ("GET", "/v1/groups/{group}/offsets"): Op(
        "A consumer group's committed offsets", (200, "Offsets"),
        {"topic": _NAME, "consistency": _Q_CONSISTENCY, "timeout_ms": _Q_TIMEOUT},
        None, (404, *_READ),
    ),
    ("POST", "/v1/groups/{group}/offsets"): Op(
        "Commit consumer offsets (through the log)", (200, "Offsets"),
        {"timeout_ms": _Q_TIMEOUT}, "CommitOffsetsRequest", (404, 416, *_BODY, *_WRITE),
    ),
    ("POST", "/v1/groups/{group}/reset"): Op(
        "Reset a group's offsets on a topic", (200, "Offsets"), {"timeout_ms": _Q_TIMEOUT},
        "ResetRequest", (404, *_BODY, *_WRITE),
    ),
    ("PUT", "/v1/retention"): Op(
        "Set retention and producer expiry", (200, "Retention"), {"timeout_ms": _Q_TIMEOUT},
        "RetentionRequest", (*_BODY, *_WRITE),
    ),
    ("GET", "/v1/cluster"): Op(
        "Node, Raft and broker status (members, roles, leader, term, commit index, "
        "confirm offset, lag per replica, lease remaining, epoch map)",
        (200, "ClusterStatus"),
    ),
    ("POST", "/v1/cluster/transfer-leadership"): Op(
        "Transfer leadership to a caught-up voter", (200, "Transfer"),
        {"timeout_ms": _Q_TIMEOUT}, "TransferRequest", (*_BODY, *_WRITE),
    ),
    ("POST", "/v1/cluster/members"): Op(
        "Add a learner, promote a learner, or remove a member", (200, "Membership"),
        {"timeout_ms": _Q_TIMEOUT}, "MembersRequest", (*_BODY, *_WRITE),
    ),
    ("GET", "/readyz"): Op(
        "Ready: a leader is known and this node applied all it knows committed",
        (200, "Ready"),
    ),
    ("GET", "/healthz"): Op("The process is up", (200, "Health"), extra={503: "Health"}),
    ("GET", "/metrics"): Op("Prometheus text format", (200, ""), content="text/plain"),
    ("GET", "/openapi.json"): Op("This document", (200, "OpenApiDocument")),
    # operator routes of dledger.admin_http
    ("GET", "/raft/status"): Op("Raft status of this node", (200, "RaftStatus")),
    ("POST", "/raft/propose"): Op(
        "Propose the raw request body as one log entry (operator/test route)",
        (200, "Proposed"), {"timeout_ms": _Q_TIMEOUT}, "", (400, 409, 413, 422, 307, 504),
    ),
    ("GET", "/raft/read"): Op(
        "A read barrier", (200, "ReadBarrier"),
        {"consistency": {"enum": ["committed", "linearizable"], "default": "linearizable"},
         "timeout_ms": _Q_TIMEOUT},
        None, (400, *_READ),
    ),
    ("GET", "/raft/applied"): Op(
        "Applied records", (200, "AppliedRecords"),
        {"from": _int(1), "max": _int(1, 10_000)}, None, (400, 422),
    ),
    ("GET", "/raft/messages"): Op(
        "Recent applied payloads", (200, "AppliedMessages"),
        {"from": _int(1), "max": _int(1, 10_000)}, None, (400, 422),
    ),
    ("POST", "/raft/transfer"): Op(
        "Transfer leadership", (200, "Transfer"), {"to": _int(1), "timeout_ms": _Q_TIMEOUT},
        None, (400, 422, 307, 409, 504), required=("to",),
    ),
    ("POST", "/raft/members"): Op(
        "Change membership", (200, "Membership"), {"timeout_ms": _Q_TIMEOUT},
        "MembersRequest", (*_BODY, *_WRITE),
    ),
    ("POST", "/raft/bench"): Op(
        "Drive this leader from inside its process (benchmarks)", (200, "BenchResult"),
        {"n": _int(1, 10_000_000), "size": _int(0), "window": _int(1), "rate": {"type": "number"}},
        None, (400, 422, 307, 409, 504),
    ),
}  # fmt: skip


def _operation(
    method: str, path: str, op: Op | None, role: str | None, auth_on: bool
) -> dict[str, Any]:
    params: list[dict[str, Any]] = []
    for name in _PARAM.findall(path):
        schema = (op.path_schemas.get(name) if op else None) or (
            _NAME if name in ("topic", "group") else _STR
        )
        params.append({"name": name, "in": "path", "required": True, "schema": schema})
    responses: dict[str, Any] = {}
    if op is None:
        out: dict[str, Any] = {
            "summary": f"{method} {path}",
            "x-undocumented": True,
            "parameters": params,
            "responses": {"default": {"description": "undocumented"}},
        }
        return out
    params += [
        {"name": n, "in": "query", "required": n in op.required, "schema": s}
        for n, s in op.query.items()
    ]
    status, ok_schema = op.ok
    if op.content == "application/json":
        responses[str(status)] = {
            "description": "OK" if status == 200 else "Created",
            "content": {"application/json": {"schema": _ref(ok_schema)}},
        }
        for media, text in op.alt_content.items():
            responses[str(status)]["content"][media] = {
                "schema": {"type": "string", "contentMediaType": media, "description": text}
            }
        if op.ok_headers:
            responses[str(status)]["headers"] = {
                h: {"schema": _int(0), "description": text} for h, text in op.ok_headers.items()
            }
    else:
        responses[str(status)] = {
            "description": "OK",
            "content": {op.content: {"schema": {"type": "string"}}},
        }
    for st, name in op.extra.items():
        responses[str(st)] = {
            "description": "see schema",
            "content": {"application/json": {"schema": _ref(name)}},
        }
    errors = set(op.errors) | set(_ALWAYS if role != "public" else (429, 503, *_EDGE))
    if _PARAM.search(path):
        errors.add(404)  # unknown topic or group, or a path value that matches no route
    errors.add(422)  # an unknown query parameter, or a value its schema refuses
    for st in sorted(errors):
        if str(st) in responses:
            continue
        if st == 307:
            responses["307"] = {
                "description": "Not the leader: Location names the leader's URL",
                "headers": {"Location": {"schema": _STR, "required": True}},
                "content": {"application/json": {"schema": _ref("NotLeaderError")}},
            }
            continue
        entry: dict[str, Any] = {
            "description": _ERROR_TEXT.get(st, "error"),
            "content": {"application/json": {"schema": _ref("Error")}},
        }
        if st in (429, 503):
            entry["headers"] = {"Retry-After": {"schema": _STR, "required": True}}
        if st == 401:
            entry["headers"] = {"WWW-Authenticate": {"schema": _STR, "required": True}}
        responses[str(st)] = entry
    out = {
        "summary": op.summary,
        "operationId": _operation_id(method, path),
        "parameters": params,
        "responses": responses,
    }
    if role is not None:
        out["x-required-role"] = role
        if auth_on:
            out["security"] = [] if role == "public" else [{"bearer": []}]
    if op.body is not None:
        out["requestBody"] = {
            # an empty body stands for {}: required when the schema requires a field
            "required": op.body != "" and bool(SCHEMAS[op.body].get("required")),
            "content": (
                {"application/json": {"schema": _ref(op.body)}}
                if op.body
                else {"application/octet-stream": {"schema": {"type": "string"}}}
            ),
        }
        for media, text in op.body_alt.items():
            out["requestBody"]["content"][media] = {
                "schema": {"type": "string", "format": "binary"}
            }
            out["requestBody"]["description"] = text
    return out


_ERROR_TEXT = {
    400: "The body is not JSON (or a query value cannot be parsed)",
    401: "Missing or invalid bearer token (auth on)",
    403: "The token lacks the route's role (auth on)",
    404: "Unknown topic or group, or no such route",
    409: "Conflict: exists, sequence gap, fenced producer, proposal dropped",
    408: "The body did not arrive within the node's body timeout",
    413: "Body (as sent or inflated), message or batch too large",
    406: "Accept asks for a type this node cannot produce (Arrow without pyarrow)",
    415: "Unsupported Content-Encoding, or a binary body where it is not taken",
    416: "Offset out of range; the valid range is in the body",
    422: "A field is invalid; field names it",
    429: "Overloaded; retry after Retry-After",
    503: "No leader known, leader not ready, or stopping; retry after Retry-After",
    504: "No answer in time; a write's outcome is unknown",
}


def _operation_id(method: str, path: str) -> str:
    words = re.sub(r"[{}]", "", path).strip("/").replace(".", "_").replace("-", "_")
    return method.lower() + "_" + re.sub(r"[^A-Za-z0-9]+", "_", words)


_ENCODINGS = ("base64", "utf-8")


def plain_message(m: Any) -> bool:
    """Whether ``m`` is a plain message, ``{"value": <string>}`` with at most
    an ``encoding`` of ``base64`` or ``utf-8``: the shape of nearly every
    message of a big batch, which :data:`SCHEMAS`' ``MessageIn`` accepts
    (tests/http/test_parse.py checks that it never says yes to anything the
    schema refuses). Its caps do not apply: they bound the other fields."""
    if type(m) is not dict:
        return False
    n = len(m)
    if type(m.get("value")) is not str:
        return False
    if n == 1:
        return True
    e = m.get("encoding")
    return n == 2 and type(e) is str and e in _ENCODINGS


# Quick predicates per component (http_api.schema.Quick): values they say
# yes to skip the schema walk.
QUICK = {"MessageIn": plain_message}


def request_schemas(
    max_batch_messages: int = 10_000, max_message_properties: int = 64
) -> dict[str, dict[str, Any]]:
    """:data:`SCHEMAS` with the node's caps filled in (maxItems of a
    produce's messages and of a commit's offsets, maxProperties of a
    message's properties, maxItems of its keys and tags)."""
    out = dict(SCHEMAS)
    msg = dict(out["MessageIn"])
    msg_props = dict(msg["properties"])
    msg_props["properties"] = {**msg_props["properties"], "maxProperties": max_message_properties}
    msg_props["keys"] = {**msg_props["keys"], "maxItems": MAX_KEYS}
    msg_props["tags"] = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": MAX_KEYS}]}
    commit = dict(out["CommitOffsetsRequest"])
    commit_props = dict(commit["properties"])
    commit_props["offsets"] = {**commit_props["offsets"], "maxItems": max_batch_messages}
    out["CommitOffsetsRequest"] = {**commit, "properties": commit_props}
    out["MessageIn"] = {**msg, "properties": msg_props}
    req = dict(out["ProduceRequest"])
    req_props = dict(req["properties"])
    req_props["messages"] = {**req_props["messages"], "maxItems": max_batch_messages}
    out["ProduceRequest"] = {**req, "properties": req_props}
    return out


def openapi_document(
    app: web.Application,
    roles: dict[tuple[str, str], str] | None = None,
    auth_on: bool = False,
    public: tuple[str, ...] = (),
    schemas: dict[str, dict[str, Any]] | None = None,
    limits: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The document of ``app``'s routes; ``roles`` (the auth table) adds
    each operation's ``x-required-role`` and, with ``auth_on``, its security.
    ``schemas``: :func:`request_schemas` with the node's caps; ``limits``:
    the node's HTTP caps and timeouts, published as ``info.x-limits``."""
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        method = route.method.upper()
        if method in ("HEAD", "*") or route.resource is None:
            continue
        path = route.resource.canonical
        role: str | None = None
        if roles is not None:
            role = (
                "public"
                if method == "GET" and path in public
                else roles.get((method, path), "admin")
            )
        op = _operation(method, path, OPERATIONS.get((method, path)), role, auth_on)
        paths.setdefault(path, {})[method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "DLedger-py",
            "version": "0.1.0",
            "description": "A RocketMQ-style CommitLog replicated by Raft: produce, consume, "
            "consumer groups, topic and cluster admin. Errors share one envelope.",
            **({"x-limits": limits} if limits is not None else {}),
        },
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": schemas if schemas is not None else SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    return doc
