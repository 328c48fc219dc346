"""The external peers run for real, briefly: a 3-member etcd cluster and a
3-server NATS JetStream cluster start, take 100 writes from the benchmark's
own load generators, and are stopped by PID with no process left behind.
Each skips with the install command when its server is not installed."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request
from pathlib import Path

import pytest

from benchmarks import peer_etcd, peer_nats, peer_procs
from benchmarks.loadgen import closed_loop

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


def _revision(reply: dict[str, object]) -> int:
    header = reply["header"]
    assert isinstance(header, dict)
    return int(header["revision"])


@pytest.mark.skipif(peer_etcd.etcd_binary() is None, reason=peer_etcd.INSTALL_HINT)
def test_etcd_cluster_takes_puts_and_stops(tmp_path: Path) -> None:
    with peer_etcd.etcd_cluster(tmp_path / "etcd") as (ec, leader):
        pids = ec.pids
        assert len(pids) == 3 and all(not peer_procs.process_gone(p) for p in pids)
        r = asyncio.run(
            closed_loop(
                leader + "/v3/kv/put",
                peer_etcd.put_body(100),
                concurrency=4,
                duration_s=20,
                msgs_per_req=1,
                total_requests=100,
            )
        )
        assert r["requests_ok"] == 100 and r["errors"] == {}
        # a batch: one transaction of 100 puts
        with urllib.request.urlopen(
            urllib.request.Request(
                leader + "/v3/kv/txn",
                data=peer_etcd.txn_body(100, 100),
                headers={"content-type": "application/json"},
            ),
            timeout=5,
        ) as resp:
            txn = json.loads(resp.read())
        assert txn["succeeded"] is True and len(txn["responses"]) == 100
        # read back from another member: 100 revisions of the one key, then the txn
        other = next(u for u in ec.client_urls if u != leader)
        key = base64.b64encode(b"bench/0").decode()
        got = _post(other + "/v3/kv/range", {"key": key})
        kvs = got["kvs"]
        assert isinstance(kvs, list) and len(kvs) == 1
        assert int(kvs[0]["version"]) == 100
        assert base64.b64decode(kvs[0]["value"]) == peer_etcd.value_of(100)
        assert _revision(got) == 1 + 100 + 1  # initial revision, 100 puts, one txn
    assert all(peer_procs.process_gone(p) for p in pids)
    assert not set(pids) & set(peer_procs.live_pids())


async def _stream_messages(url: str) -> int:
    import nats

    nc = await nats.connect(servers=[url], connect_timeout=5, max_reconnect_attempts=1)
    try:
        info = await nc.jetstream().stream_info(peer_nats.STREAM)
        assert info.config.num_replicas == 3
        return int(info.state.messages)
    finally:
        await nc.close()


@pytest.mark.skipif(peer_nats.missing() is not None, reason=str(peer_nats.missing()))
def test_nats_cluster_takes_publishes_and_stops(tmp_path: Path) -> None:
    with peer_nats.nats_cluster(tmp_path / "nats") as (nc, leader):
        pids = nc.pids
        assert len(pids) == 3 and all(not peer_procs.process_gone(p) for p in pids)
        r = asyncio.run(
            peer_nats.closed_loop(
                leader,
                b"m" * 100,
                concurrency=4,
                duration_s=20,
                msgs_per_req=1,
                total_requests=100,
            )
        )
        assert r["requests_ok"] == 100 and r["errors"] == {}
        b = asyncio.run(
            peer_nats.closed_loop(
                leader, b"m" * 100, concurrency=1, duration_s=20, msgs_per_req=100, total_requests=1
            )
        )
        assert b["requests_ok"] == 1
        # acknowledged by the stream, seen from another server
        other = next(u for u in nc.client_urls if u != leader)
        assert asyncio.run(_stream_messages(other)) == 200
    assert all(peer_procs.process_gone(p) for p in pids)
    assert not set(pids) & set(peer_procs.live_pids())
