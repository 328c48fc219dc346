"""Issue 14 on real processes: a follower killed (SIGKILL, by PID) while the
others go on producing past several log compactions catches up

* by ordinary replication when what it missed is still in the retained log
  (no snapshot installed), and
* by an index-only snapshot plus the retained log once retention dropped
  the log past it,

and then every replica answers the same reads, message for message.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import pytest

from dledger.cluster import http_request
from tests.http.apiclient import ApiCluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

QUEUES = 2
BATCH = 20  # messages per produce request, one log entry each
VALUE = 100  # bytes per message
# Retention keeps about 150 entries' records; a snapshot may be considered
# every 40 entries. Producing 600 entries therefore drops the log front
# several times.
KEEP_BYTES = 150 * BATCH * (VALUE + 40)


def _produce(c: ApiCluster, leader: int, entries: int, tag: str) -> None:
    for k in range(entries):
        body = json.dumps(
            {
                "messages": [
                    {"value": f"{tag}-{k}-{j}-".ljust(VALUE, "x"), "encoding": "utf-8"}
                    for j in range(BATCH)
                ]
            }
        ).encode()
        r = http_request(c.http(leader), "POST", "/v1/topics/t/messages", body, timeout_s=15)
        assert r.status == 200, (r.status, r.body[:300])


def _status(c: ApiCluster, nid: int) -> dict[str, Any]:
    st = c.status(nid, timeout_s=5)
    assert st is not None, f"node {nid} does not answer /raft/status"
    return st


def _answers(c: ApiCluster, nid: int) -> dict[int, Any]:
    """Every retained message of every queue as node ``nid`` reads it
    (committed reads served by that node itself)."""
    out: dict[int, Any] = {}
    r = http_request(c.http(nid), "GET", "/v1/topics/t", timeout_s=5)
    assert r.status == 200, (nid, r.status, r.body[:300])
    for q in r.json()["queues"]:
        qid, lo, hi = q["queue"], q["min_offset"], q["max_offset"]
        got: list[dict[str, Any]] = []
        off = lo
        while off < hi:
            rr = http_request(
                c.http(nid),
                "GET",
                f"/v1/topics/t/queues/{qid}/messages?offset={off}&max_messages=500"
                "&encoding=utf-8&consistency=committed",
                timeout_s=10,
            )
            assert rr.status == 200, (nid, qid, off, rr.status, rr.body[:300])
            msgs = rr.json()["messages"]
            assert msgs, (nid, qid, off, hi)
            got += msgs
            off = rr.json()["next_offset"]
        out[qid] = (lo, hi, got)
    return out


def _converged(c: ApiCluster, leader: int) -> bool:
    sts = [c.status(n, timeout_s=5) for n in c.ids()]
    if any(s is None or "applied" not in s for s in sts):
        return False
    lead = _status(c, leader)
    return all(s is not None and s["applied"] >= lead["commit"] for s in sts)


def _same_answers(c: ApiCluster, leader: int) -> dict[int, Any]:
    wait_for(lambda: _converged(c, leader), 120, "every replica to apply the leader's commit")
    ref = _answers(c, leader)
    for nid in c.ids():
        assert _answers(c, nid) == ref, f"node {nid} answers differently from the leader"
    return ref


def test_a_killed_follower_catches_up_by_log_within_retention_and_by_snapshot_behind_it(
    api_cluster: Callable[..., ApiCluster],
) -> None:
    c = api_cluster(
        voters=3,
        settings={
            "snapshot_every_entries": 40,
            "snapshot_trailing_entries": 5,
            # entries stay in the leader's memory cache after compaction; a
            # small one, so that "behind the log's front" means it here
            "log_cache_bytes": 64 << 10,
            # and while a follower is down, the leader keeps sending it
            # entries until this many bytes are unacknowledged; the
            # transport delivers what it queued once the follower is back
            "max_inflight_bytes": 64 << 10,
        },
    )
    leader = c.wait_leader()
    st, res = c.call("POST", "/v1/topics", {"name": "t", "queues": QUEUES})
    assert st == 201, res
    r = http_request(
        c.http(leader),
        "PUT",
        "/v1/retention",
        json.dumps({"max_bytes": KEEP_BYTES, "max_age_ms": 0}).encode(),
        timeout_s=10,
        headers={"Content-Type": "application/json", **c.admin_headers()},
    )
    assert r.status == 200, (r.status, r.body[:300])
    # Fill well past retention: the log front moves, snapshots are taken.
    _produce(c, leader, 400, "fill")
    wait_for(
        lambda: _status(c, leader)["storage"]["first_index"] > 100,
        60,
        "the leader to compact its log behind retention",
    )
    _same_answers(c, leader)

    # 1. Within retention: the follower misses fewer entries than the log
    # retains. The leader compacts meanwhile, up to a snapshot it built
    # before the follower stopped (a snapshot waits until retention has
    # dropped every record in the entries it covers).
    lag = next(n for n in c.ids() if n != leader)
    k = 0
    while _status(c, leader)["snapshot"]["pending_index"] == 0:
        assert k < 40, "the leader never built a snapshot to wait for retention"
        _produce(c, leader, 10, f"more{k}")
        k += 1
    pending = _status(c, leader)["snapshot"]["pending_index"]
    wait_for(lambda: _status(c, lag)["applied"] >= pending, 60, "the follower to apply it")
    installed = _status(c, lag)["snapshot"]["installed"]
    behind = _status(c, lag)["applied"]
    c.kill(lag, signal.SIGKILL)
    front = _status(c, leader)["storage"]["first_index"]
    k = 0
    while _status(c, leader)["storage"]["first_index"] == front:
        assert k < 40, "the leader never compacted while the follower was down"
        _produce(c, leader, 10, f"within{k}")
        k += 1
    assert front < _status(c, leader)["storage"]["first_index"] <= behind + 1
    c.start(lag)
    ref = _same_answers(c, leader)
    lag_st = _status(c, lag)
    assert lag_st["snapshot"]["installed"] == installed, "it should have caught up by the log"
    assert lag_st["snapshot"]["restored_from_checkpoint"] > 0, "a restart does not rebuild"
    assert sum(len(v[2]) for v in ref.values()) > 100 * BATCH

    # 2. Behind retention: the others produce until their log starts after
    # everything the follower has; it installs a snapshot, then replicates.
    lag = next(n for n in c.ids() if n not in (leader, lag))
    installed = _status(c, lag)["snapshot"]["installed"]
    behind = _status(c, lag)["applied"]
    c.kill(lag, signal.SIGKILL)
    k = 0
    # (past what the leader sent it before noticing: up to max_inflight_bytes
    # of entries wait in the transport's queue and arrive first)
    while _status(c, leader)["storage"]["first_index"] <= behind + 100:
        assert k < 40, "the leader's log never moved past the stopped follower"
        _produce(c, leader, 40, f"behind{k}")
        k += 1
    _produce(c, leader, 40, "tail")
    snap_bytes = _status(c, leader)["snapshot"]["bytes"]
    c.start(lag)
    ref = _same_answers(c, leader)
    lag_st = _status(c, lag)
    assert lag_st["snapshot"]["installed"] > installed, "it should have installed a snapshot"
    # The snapshot carries no records: none of the message bodies is in the
    # leader's snapshot file, and it is smaller than the retained bodies.
    kept = sum(len(v[2]) for v in ref.values())
    snaps = sorted(c.data_dir(leader).glob("snapshot-*.snap"))
    assert snaps, list(c.data_dir(leader).iterdir())
    raw = snaps[-1].read_bytes()
    assert snap_bytes > 0 and len(raw) < kept * VALUE, (snap_bytes, len(raw), kept)
    for tag in (b"fill-", b"within", b"behind", b"tail-"):
        assert tag not in raw, f"a message body ({tag!r}...) is in the snapshot file"
    # and every message produced in the tail is readable everywhere
    assert any(m["value"].startswith("tail-39-") for v in ref.values() for m in v[2])
