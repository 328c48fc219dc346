"""Controller commands as Raft entry payloads.

Layout: ``MAGIC`` (4 bytes) + version (1 byte) + CRC32 of the body (4 bytes,
big-endian) + the body, a JSON object (orjson, sorted keys) with an ``op``
field. Controller commands are small (a heartbeat is ~200 bytes) and few (a
few per second), so JSON costs nothing that matters and stays readable in
``/raft/messages``. Never pickle.

Every command carries ``ts_ms``: the controller leader's wall clock when it
proposed the command. Replicas never read their own clock; the state's
"now" is the largest ``ts_ms`` applied so far, so liveness decided from it is
the same on every replica.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import orjson

from broker_adapter.errors import MalformedCommand

MAGIC = b"DLCT"
VERSION = 1
_HDR = struct.Struct(">4sBI")

OPS = (
    "heartbeat",
    "tick",
    "create_topic",
    "update_topic",
    "delete_topic",
    "alter_sync_state_set",
)


def is_command(data: bytes) -> bool:
    return data[:4] == MAGIC


def encode(op: str, ts_ms: int, **fields: Any) -> bytes:
    if op not in OPS:
        raise ValueError(f"unknown controller op {op!r}")
    body = orjson.dumps({"op": op, "ts_ms": ts_ms, **fields}, option=orjson.OPT_SORT_KEYS)
    return _HDR.pack(MAGIC, VERSION, zlib.crc32(body)) + body


def decode(data: bytes) -> dict[str, Any]:
    """The command's fields; raises MalformedCommand."""
    if len(data) < _HDR.size:
        raise MalformedCommand("controller command is truncated")
    magic, version, crc = _HDR.unpack_from(data, 0)
    if magic != MAGIC:
        raise MalformedCommand("not a controller command")
    if version != VERSION:
        raise MalformedCommand(f"controller command version {version} is not supported")
    body = bytes(data[_HDR.size :])
    if zlib.crc32(body) != crc:
        raise MalformedCommand("controller command CRC mismatch")
    try:
        v = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedCommand(f"controller command is not JSON: {exc}") from None
    if not isinstance(v, dict) or v.get("op") not in OPS or not isinstance(v.get("ts_ms"), int):
        raise MalformedCommand("controller command has no known op or no ts_ms")
    return v


def heartbeat(
    ts_ms: int,
    group: str,
    node_id: int,
    http: str,
    *,
    leader: bool,
    term: int,
    knows_leader: bool,
    members: list[tuple[int, str]],
    routes_version: int = 0,
    replica: dict[str, Any] | None = None,
) -> bytes:
    """One broker node's heartbeat: it is alive, whether it leads its group
    (a ready leader: it can take writes), whether it knows any leader at its
    ``term``, its group's address book, and (from a leader) the route-table
    version its group has applied (created and deleted its queues for).

    ``replica``: a node of a controller-mode group adds ``{"epoch": the
    epoch it serves or follows, "max_offset": its CommitLog's length,
    "unclean": its group's enable_elect_unclean_master}``; its ``leader``
    means "I am the master of ``term`` (= that epoch) and take writes"."""
    extra: dict[str, Any] = {} if replica is None else {"replica": replica}
    return encode(
        "heartbeat",
        ts_ms,
        group=group,
        node_id=node_id,
        http=http,
        leader=leader,
        term=term,
        knows_leader=knows_leader,
        routes_version=routes_version,
        members=[[i, a] for i, a in members],
        **extra,
    )


def tick(ts_ms: int) -> bytes:
    return encode("tick", ts_ms)


def create_topic(ts_ms: int, topic: str, queues: int) -> bytes:
    return encode("create_topic", ts_ms, topic=topic, queues=queues)


def update_topic(ts_ms: int, topic: str, queues: int) -> bytes:
    return encode("update_topic", ts_ms, topic=topic, queues=queues)


def delete_topic(ts_ms: int, topic: str) -> bytes:
    return encode("delete_topic", ts_ms, topic=topic)


def alter_sync_state_set(
    ts_ms: int, group: str, master: int, epoch: int, sync_state_set_epoch: int, new_set: list[int]
) -> bytes:
    """A controller-mode master asks for a new SyncStateSet; applied only if
    ``master`` and ``epoch`` are still the group's and the set it changes is
    still ``sync_state_set_epoch``."""
    return encode(
        "alter_sync_state_set",
        ts_ms,
        group=group,
        master=master,
        epoch=epoch,
        sync_state_set_epoch=sync_state_set_epoch,
        new_set=sorted(new_set),
    )
