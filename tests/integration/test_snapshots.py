"""Snapshots in the runtime, with real node processes: every node snapshots
and compacts its log, a restarted node starts from its snapshot instead of
index 1, a far-behind follower catches up by InstallSnapshot, and a full
restart after snapshots keeps every acknowledged entry."""

from __future__ import annotations

import signal
import uuid
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from dledger.cluster import http_request

if TYPE_CHECKING:
    from conftest import TestCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MakeCluster = Callable[..., "TestCluster"]
SETTINGS: dict[str, object] = {"snapshot_every_entries": 50, "snapshot_trailing_entries": 5}


def _payload(tag: str) -> bytes:
    return f"{tag}-{uuid.uuid4().hex}".encode()


def _write(c: TestCluster, n: int, tag: str) -> dict[int, tuple[int, int]]:
    acked: dict[int, tuple[int, int]] = {}
    for k in range(n):
        data = _payload(f"{tag}-{k}")
        out = c.propose_ok(data)
        acked[zlib.crc32(data)] = (out.index, out.term)
    return acked


def _assert_acked_present(
    acked: dict[int, tuple[int, int]], records: list[tuple[int, int, int]]
) -> None:
    by_index = {i: (t, c) for i, t, c in records}
    for checksum, (index, term) in acked.items():
        assert by_index.get(index) == (term, checksum), f"acknowledged entry {index} lost"


def _snap(c: TestCluster, nid: int) -> dict[str, Any]:
    st = c.status(nid, timeout_s=3.0)
    assert st is not None, f"node {nid} does not answer"
    return {**st["snapshot"], "first_index": st["storage"]["first_index"], "applied": st["applied"]}


def _wait_snapshot(c: TestCluster, nid: int, at_least: int) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        st = c.status(nid, timeout_s=3.0)
        if st is None or st["snapshot"]["index"] < at_least:
            return None
        return _snap(c, nid)

    out: dict[str, Any] = c.wait_for(check, 60, f"node {nid} to snapshot at >= {at_least}")
    return out


def test_every_node_snapshots_and_a_restart_starts_from_it(make_cluster: MakeCluster) -> None:
    c = make_cluster(voters=3, settings=SETTINGS)
    acked = _write(c, 120, "a")
    top = max(i for i, _ in acked.values())
    recs = c.wait_converged(c.ids(), top)
    _assert_acked_present(acked, recs)
    for nid in c.ids():
        s = _wait_snapshot(c, nid, 50)
        assert s["taken"] >= 1
        assert s["first_index"] > 1, f"node {nid} still holds its log from index 1: {s}"
    lead = c.wait_leader()
    follower = next(n for n in c.ids() if n != lead)
    before = _snap(c, follower)
    c.stop(follower)
    c.start(follower)
    c.wait_http(follower)
    after = c.wait_for(
        lambda: (s := c.status(follower, timeout_s=3.0)) is not None and s["snapshot"],
        30,
        "the restarted follower's status",
    )
    # from its snapshot, or (the broker state machine) from the checkpoint of
    # its state in the storage, which is newer
    start = max(after["restored_from"], after.get("restored_from_checkpoint", 0))
    assert start >= before["index"] >= 50
    assert "restored from snapshot at index" in c.log_tail(follower, 200)
    recs2 = c.wait_converged(c.ids(), top)
    assert recs2 == recs
    _assert_acked_present(acked, recs2)


@pytest.mark.parametrize("role", ["voter", "learner"])
def test_far_behind_follower_catches_up_by_install_snapshot(
    make_cluster: MakeCluster, role: str
) -> None:
    # With few messages in flight per follower, the leader's transport queue
    # cannot hold the whole gap for the dead follower: after it returns, the
    # leader needs entries it compacted and must send its snapshot.
    c = make_cluster(
        voters=3,
        learners=1 if role == "learner" else 0,
        settings={**SETTINGS, "max_inflight_msgs": 2},
    )
    lead = c.wait_leader()
    follower = next(m.id for m in c.spec.members if m.id != lead and m.role == role)
    acked = _write(c, 5, "before")
    c.kill(follower, signal.SIGKILL)
    acked.update(_write(c, 130, "while-down"))
    lead = c.wait_leader()
    # The leader compacted past everything the follower has.
    s = _wait_snapshot(c, lead, 100)
    assert s["first_index"] > 10
    c.start(follower)
    top = max(i for i, _ in acked.values())
    recs = c.wait_converged(c.ids(), top)
    _assert_acked_present(acked, recs)
    fs = _snap(c, follower)
    assert fs["installed"] >= 1, f"the follower caught up without a snapshot: {fs}"
    assert fs["applied"] >= top
    # And it keeps replicating normally afterwards.
    more = _write(c, 10, "after")
    recs = c.wait_converged(c.ids(), max(i for i, _ in more.values()))
    _assert_acked_present(more, recs)


def test_full_restart_after_snapshots_keeps_every_acknowledged_entry(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(voters=3, settings=SETTINGS)
    acked = _write(c, 130, "a")
    top = max(i for i, _ in acked.values())
    c.wait_converged(c.ids(), top)
    for nid in c.ids():
        _wait_snapshot(c, nid, 50)
    for nid in c.ids():
        c.send_signal(nid, signal.SIGKILL)
    for nid in c.ids():
        c.wait_exit(nid, 10)
    c.start_all()
    c.wait_leader()
    recs = c.wait_converged(c.ids(), top)
    _assert_acked_present(acked, recs)
    for nid in c.ids():
        s = _snap(c, nid)
        assert max(s["restored_from"], s.get("restored_from_checkpoint", 0)) >= 50
    c.refresh_leader()
    c.propose_ok(_payload("after-restart"))


# Chunked streaming: the "log" state machine keeps recent payloads in its
# snapshot, so a few thousand 4 KB entries make a snapshot of several MB,
# which small chunks cut into hundreds of frames.
STREAM_SETTINGS: dict[str, object] = {
    "state_machine": "log",
    "snapshot_every_entries": 500,
    "snapshot_trailing_entries": 5,
    "max_inflight_msgs": 2,
    "snapshot_stream_timeout_ms": 3000,
}


def _bench(c: TestCluster, lead: int, n: int, size: int) -> int:
    """``n`` entries of ``size`` bytes proposed inside the leader; returns the
    leader's last index afterwards."""
    r = http_request(
        c.http(lead), "POST", f"/raft/bench?n={n}&size={size}&window=100", timeout_s=120
    )
    assert r.status == 200, r.body
    st = c.status(lead, timeout_s=3.0)
    assert st is not None
    last: int = st["last_index"]
    return last


def _stream(c: TestCluster, nid: int) -> dict[str, Any]:
    st = c.status(nid, timeout_s=3.0)
    assert st is not None, f"node {nid} does not answer"
    out: dict[str, Any] = st["snapshot"]["stream"]
    return out


def test_far_behind_follower_catches_up_by_a_many_chunk_stream(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(
        voters=3,
        settings={**STREAM_SETTINGS, "snapshot_chunk_bytes": 64 << 10},
    )
    lead = c.wait_leader()
    follower = next(n for n in c.ids() if n != lead)
    acked = _write(c, 5, "before")
    c.kill(follower, signal.SIGKILL)
    top = _bench(c, lead, 1200, 4000)
    s = _wait_snapshot(c, lead, 1000)
    assert s["first_index"] > 10
    assert s["bytes"] > 4_000_000, s  # dozens of 64 KiB chunks
    c.start(follower)
    recs = c.wait_converged(c.ids(), top)
    _assert_acked_present(acked, recs)
    fs = _snap(c, follower)
    assert fs["installed"] >= 1 and fs["applied"] >= top
    rx, tx = _stream(c, follower), _stream(c, lead)
    chunks = s["bytes"] // (64 << 10)
    assert rx["snapshots_received"] >= 1
    assert rx["snapshot_chunks_received"] >= chunks
    assert tx["snapshot_chunks_sent"] >= chunks
    assert tx["snapshot_chunk_bytes_sent"] >= s["bytes"]
    assert rx["snapshot_stream_garbage"] == 0 and rx["snapshot_stream_rejects"] == 0
    leader_snap = _snap(c, lead)
    assert leader_snap["sent"] >= 1
    more = _write(c, 10, "after")
    recs = c.wait_converged(c.ids(), max(i for i, _ in more.values()))
    _assert_acked_present(more, recs)


def test_follower_killed_mid_stream_still_catches_up(make_cluster: MakeCluster) -> None:
    # Tiny chunks with one in flight make the transfer long enough to kill
    # the receiver while it holds part of the snapshot.
    c = make_cluster(
        voters=3,
        settings={**STREAM_SETTINGS, "snapshot_chunk_bytes": 4096, "snapshot_window_chunks": 1},
    )
    lead = c.wait_leader()
    follower = next(n for n in c.ids() if n != lead)
    acked = _write(c, 5, "before")
    c.kill(follower, signal.SIGKILL)
    top = _bench(c, lead, 2500, 4000)
    s = _wait_snapshot(c, lead, 2000)
    total = s["bytes"]
    assert total > 8_000_000, s
    c.start(follower)

    def partial() -> dict[str, Any] | None:
        st = c.status(follower, timeout_s=1.0)
        if st is None:
            return None
        rx: dict[str, Any] = st["snapshot"]["stream"]["receiving"]
        got = rx.get(str(lead))
        return got if got is not None and 0 < got["received"] < got["total"] else None

    got = c.wait_for(partial, 60, "the follower to hold part of the snapshot", poll_s=0.02)
    c.kill(follower, signal.SIGKILL)
    c.start(follower)
    recs = c.wait_converged(c.ids(), top, timeout_s=120)
    _assert_acked_present(acked, recs)
    fs = _snap(c, follower)
    assert fs["installed"] >= 1 and fs["applied"] >= top
    tx = _stream(c, lead)
    # The killed process's share was lost: the leader sent more than one copy.
    assert tx["snapshot_chunk_bytes_sent"] >= got["total"] + got["received"], (tx, got)
    assert tx["snapshot_chunk_rewinds"] + tx["snapshot_stream_aborts"] >= 1, tx
    rx = _stream(c, follower)
    assert rx["snapshots_received"] == 1 and rx["snapshot_stream_garbage"] == 0
