"""A node whose broker state lives in its log storage comes back from its
checkpoint at a restart, replaying only the tail, and rebuilds from the log
(never serves) when the checkpoint is damaged."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient

from dledger.config import NodeConfig
from dledger.node import Node
from dledger.storage.lmdb_store import LmdbStorage
from http_api.guard import HttpLimits
from http_api.server import make_node_app, make_state_machine
from tests.http.onenode import NodeTestServer, one_node_config


def _cfg(tmp_path: Path, **kw: Any) -> NodeConfig:
    return one_node_config(tmp_path, "ckpt", **kw)


async def _run(cfg: NodeConfig, work: Any) -> tuple[Node, Any]:
    node = Node(cfg, make_state_machine(cfg))
    await node.start()
    deadline = time.monotonic() + 10
    while not node.leader_ready():
        assert time.monotonic() < deadline, "a one-node cluster did not elect itself"
        await asyncio.sleep(0.02)
    c: TestClient[Any, Any] = TestClient(NodeTestServer(make_node_app(node), HttpLimits.of(cfg)))
    await c.start_server()
    try:
        out = await work(c)
    finally:
        await c.close()
        await node.stop()
    return node, out


async def _state(c: TestClient[Any, Any]) -> Any:
    msgs = []
    for q in (0, 1):
        r = await c.get(
            f"/v1/topics/t/queues/{q}/messages?offset=0&max_messages=200&encoding=utf-8"
        )
        if r.status == 416:  # retention moved the queue's start
            start = (await r.json())["error"]["min_offset"]
            r = await c.get(
                f"/v1/topics/t/queues/{q}/messages?offset={start}&max_messages=200&encoding=utf-8"
            )
        assert r.status == 200, await r.text()
        msgs.append([m["value"] for m in (await r.json())["messages"]])
    r = await c.get("/v1/groups/g/offsets")
    assert r.status == 200, await r.text()
    return msgs, await r.json()


async def test_a_restart_comes_back_from_the_checkpoint(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)

    async def fill(c: TestClient[Any, Any]) -> Any:
        r = await c.post("/v1/topics", json={"name": "t", "queues": 2})
        assert r.status == 201, await r.text()
        for k in range(40):
            body = {"messages": [{"value": f"m{k}", "encoding": "utf-8", "queue": k % 2}]}
            r = await c.post("/v1/topics/t/messages", json=body)
            assert r.status == 200, await r.text()
        r = await c.post(
            "/v1/groups/g/offsets", json={"offsets": [{"topic": "t", "queue": 1, "offset": 7}]}
        )
        assert r.status == 200, await r.text()
        return await _state(c)

    first, before = await _run(cfg, fill)
    assert first.counters["checkpoints"] >= 1
    stopped_at = first.applied

    second, after = await _run(cfg, _state)
    assert after == before
    # A clean stop checkpoints everything it applied: nothing is replayed.
    assert second.restored_from_checkpoint == stopped_at
    assert second.restored_from_snapshot == 0

    # Damage the checkpoint on disk: the next start refuses it, drops the
    # stored state and rebuilds it from the log, answering the same.
    st = LmdbStorage(cfg.data_dir)
    db = st.side_db(b"broker")
    with st.env.begin(write=True) as txn:
        raw = txn.get(b"checkpoint", db=db)
        assert raw is not None
        blob = bytearray(raw)
        blob[len(blob) // 2] ^= 0x01
        txn.put(b"checkpoint", bytes(blob), db=db)
    st.close()
    third, again = await _run(cfg, _state)
    assert third.counters["checkpoints_discarded"] == 1
    assert third.restored_from_checkpoint == 0
    assert again == before

    # A damaged index block: found when the checkpoint is taken back, the
    # state rebuilt from the log, the same answers.
    st = LmdbStorage(cfg.data_dir)
    db = st.side_db(b"cqblocks")
    with st.env.begin(write=True) as txn:
        cur = txn.cursor(db=db)
        assert cur.first()
        key, blk = bytes(cur.key()), bytearray(cur.value())
        blk[5] ^= 0x02
        txn.put(key, bytes(blk), db=db)
    st.close()
    fourth, again = await _run(cfg, _state)
    assert fourth.counters["checkpoints_discarded"] == 1
    assert again == before


async def test_the_log_is_compacted_only_past_the_oldest_retained_record(tmp_path: Path) -> None:
    """Records are read from the log entries that carry them: snapshots do
    not drop entries holding retained records; retention does, and what
    stays readable reads the same after a restart."""
    cfg = _cfg(tmp_path, snapshot_every_entries=20, snapshot_trailing_entries=2)

    async def produce(c: TestClient[Any, Any], n: int, start: int) -> None:
        for k in range(start, start + n):
            body = {"messages": [{"value": f"m{k}", "encoding": "utf-8", "queue": k % 2}]}
            r = await c.post("/v1/topics/t/messages", json=body)
            assert r.status == 200, await r.text()

    async def fill(c: TestClient[Any, Any]) -> Any:
        r = await c.post("/v1/topics", json={"name": "t", "queues": 2})
        assert r.status == 201, await r.text()
        await produce(c, 100, 0)
        await asyncio.sleep(0.3)  # snapshot housekeeping runs between passes
        return await _state(c)

    node, before = await _run(cfg, fill)
    # Nothing was dropped by retention: a snapshot could not let the log go,
    # so none is taken, and the log keeps every entry.
    assert node.counters["snapshots_taken"] == 0
    # nor built to wait: one would sit in memory and on disk for as long as
    # nothing is dropped
    assert node._pending_snap is None
    assert not list(Path(cfg.data_dir).glob("snapshot-*"))
    st = node._storage
    assert st is not None
    assert st.first_index() == 1
    assert before[0][0][:2] == ["m0", "m2"]

    async def shrink(c: TestClient[Any, Any]) -> Any:
        # keep about the newest 30 records (each ~60 bytes on the CommitLog)
        r = await c.put("/v1/retention", json={"max_bytes": 30 * 60, "max_age_ms": 0})
        assert r.status == 200, await r.text()
        # Retention lets the log go as these arrive: a snapshot is built
        # (the state at that point) and taken once retention passed it.
        await produce(c, 60, 100)
        await asyncio.sleep(0.3)
        await produce(c, 40, 160)
        await asyncio.sleep(0.3)
        # (a snapshot built meanwhile is taken once retention passed it)
        await produce(c, 60, 200)
        await asyncio.sleep(1.5)  # a quiet node looks at a waiting snapshot once a second
        return await _state(c)

    node, after = await _run(cfg, shrink)
    assert node.counters["snapshots_taken"] >= 1, (
        node._pending_snap and node._pending_snap[0].meta,
        node.applied,
    )
    st = node._storage
    assert st is not None
    kept = after[0][0] + after[0][1]
    assert 10 < len(kept) < 100 and "m259" in kept and "m0" not in kept
    assert st.first_index() > 20, "retention dropped records but the log was never compacted"
    _, again = await _run(cfg, _state)
    assert again == after
