"""A replica whose damage lies outside the tail it verifies at start-up.

The corrupt nemesis flips bits anywhere in a stopped node's data file. When
they miss the verified tail the node starts, and finds the damage only when
a read reaches the damaged record (seen in a three-group run: a replica
rebuilt its state from the log, then answered ``STORAGE_CORRUPTED`` to every
read of two queues until the run ended, still voting and leading). What
must hold, on real processes: the read is refused with ``503
STORAGE_CORRUPTED`` naming the record, never served; the replica then stops
by itself with exit code 2 (the CLI's code for damaged data: rebuild it from
a healthy peer) instead of going on around the hole; the replicas checker
counts that refusal as right for a node the nemesis damaged and as a defect
for any other.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dledger.storage.lmdb_store import LmdbStorage
from jepsen_like import replicas
from jepsen_like.control import Cluster

pytestmark = [pytest.mark.jepsen, pytest.mark.timeout(240)]

TOPIC = "dmg"


async def _until(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


async def _post(s: aiohttp.ClientSession, c: Cluster, path: str, body: Any) -> dict[str, Any]:
    for _ in range(100):
        lead = await c.leader()
        if lead is not None:
            try:
                async with s.post(
                    f"http://{c.members[lead].http}{path}",
                    json=body,
                    timeout=aiohttp.ClientTimeout(total=3),
                    allow_redirects=False,
                ) as r:
                    if r.status in (200, 201):
                        return dict(await r.json())
            except (aiohttp.ClientError, TimeoutError):
                pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"POST {path} never succeeded")


def _damage(data_dir: Path, marker: bytes) -> int:
    """Flip one bit inside the log record that carries ``marker``; its index."""
    st = LmdbStorage(str(data_dir))
    try:
        with st.env.begin(write=True) as txn:
            cur = txn.cursor(db=st._log_db)
            for key, value in cur:
                raw = bytearray(value)
                at = raw.find(marker)
                if at >= 0:
                    raw[at] ^= 0x01
                    txn.put(bytes(key), bytes(raw), db=st._log_db)
                    return int.from_bytes(bytes(key), "big")
    finally:
        st.close()
    raise AssertionError(f"no log record carries {marker!r}")


async def _exit_code(c: Cluster, node: int) -> int:
    proc = c.members[node].proc
    assert proc is not None
    await _until(lambda: proc.poll() is not None, 30, f"node {node} to stop by itself")
    return int(proc.returncode)


async def test_damage_found_by_a_read_is_refused_and_stops_the_replica(
    tmp_path: Path, machine: None
) -> None:
    c = Cluster(
        tmp_path / "cluster",
        voters=3,
        netns=False,
        # Verify only the last 5 entries at start-up: the damaged record
        # (the 4th message of 40) lies outside, so the node starts.
        node_settings={"verify_tail_entries": 5},
    )
    c.write_cluster_file()
    try:
        c.start_all()
        assert await c.wait_ready(timeout_s=60)
        async with aiohttp.ClientSession() as s:
            await _post(s, c, "/v1/topics", {"name": TOPIC, "queues": 1})
            for k in range(40):
                msg = {"value": f"message-{k:03d}", "encoding": "utf-8", "queue": 0}
                await _post(s, c, f"/v1/topics/{TOPIC}/messages", {"messages": [msg]})
            lead = await c.leader()
            victim = next(i for i in c.ids if i != lead)
            await _until(
                lambda: replicas.compare(c, TOPIC, 1, timeout_s=5),
                30,
                "every replica to hold the 40 messages",
            )
            # A clean stop (its checkpoint covers everything: no replay at start).
            c.signal(victim, signal.SIGTERM)
            assert await _exit_code(c, victim) == 0
            index = _damage(c.members[victim].data_dir, b"message-003")
            print(f"damaged node {victim}'s record at log index {index}")

            # 1. Nothing says the damage was made on purpose: a defect.
            c.start(victim)
            assert await c.wait_ready([victim], timeout_s=60)
            res = await replicas.compare(c, TOPIC, 1, timeout_s=30)
            assert res["verdict"] == "invalid" and res["unreadable_nodes"] == [victim], res
            report = res["damage_reports"][victim]
            assert "dmg/0@3" in report and f"log index {index}" in report, report
            # ... and the replica stopped instead of serving around the hole.
            assert await _exit_code(c, victim) == 2
            c.members[victim].expected_exit = True
            assert "StorageCorrupted" in c.log_tail(victim, 40), c.log_tail(victim, 40)

            # 2. The same damage, made by the nemesis: a right refusal.
            c.start(victim)
            assert await c.wait_ready([victim], timeout_s=60)
            res = await replicas.compare(c, TOPIC, 1, damaged={victim}, timeout_s=30)
            assert res["verdict"] == "valid", res
            assert res["refused_damaged_nodes"] == [victim] and not res["unreadable_nodes"], res
            assert await _exit_code(c, victim) == 2
            c.members[victim].expected_exit = True
            # The others serve all 40, in order.
            for i in c.ids:
                if i == victim:
                    continue
                got = await replicas.read_queue(s, c.members[i].http, TOPIC, 0)
                assert got is not None
                assert [v for _, v in got] == [f"message-{k:03d}" for k in range(40)], (i, got)
    finally:
        c.stop_all()
        await c.close()
